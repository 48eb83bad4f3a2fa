//! A request body read into memory against a shared byte budget (R25, R31).
//!
//! The budget counts the memory a body holds, its buffers' capacity, not
//! only the bytes received, and a body never reallocates while it is read:
//! a buffer grown by doubling holds up to twice what it received, and the
//! allocator may keep the buffers it outgrew resident for a while, so
//! bodies being read held up to twice `--max-buffered-bytes`.
//!
//! A body that declares its length (`Content-Length`) is read into one
//! buffer of that length, taken from the budget when its first bytes
//! arrive (memory that is never touched is never resident, but it is
//! promised). A body of unknown length (chunked) is read into blocks of
//! [`BLOCK`] bytes, each paid for before it is allocated, and joined once
//! when the body is complete.

use bytes::Bytes;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The size of a block of a body of unknown length.
pub(crate) const BLOCK: usize = 64 << 10;

/// Why a body could not be kept.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The body is longer than the message limit (413).
    TooLarge,
    /// The shared budget is spent (503, try again).
    Busy,
}

/// A body being read: its bytes and its share of the budget.
pub(crate) struct BodyBuffer {
    /// The body's bytes, in buffers that are filled and never grown.
    blocks: Vec<Vec<u8>>,
    /// The bytes received.
    len: usize,
    /// The capacity of every block: the memory the body holds.
    capacity: usize,
    /// The budget's bytes this body holds: its capacity beyond the
    /// allowance.
    permit: Option<OwnedSemaphorePermit>,
    budget: Arc<Semaphore>,
    /// The first bytes of each body, not counted (a small request is never
    /// refused for lack of budget).
    allowance: usize,
    /// The longest body kept.
    max: usize,
    /// What the body said its length is (`Content-Length`), if it did.
    declared: Option<usize>,
}

impl BodyBuffer {
    pub(crate) fn new(
        budget: Arc<Semaphore>,
        allowance: usize,
        max: usize,
        declared: Option<u64>,
    ) -> Self {
        Self {
            blocks: Vec::new(),
            len: 0,
            capacity: 0,
            permit: None,
            budget,
            allowance,
            max,
            declared: declared.and_then(|n| usize::try_from(n).ok()),
        }
    }

    /// Appends a frame of the body, in new blocks paid for from the budget
    /// when the last one is full.
    pub(crate) fn push(&mut self, mut data: &[u8]) -> Result<(), Refused> {
        // A body that says it is too long is refused before it holds any
        // of the budget.
        if self.len.saturating_add(data.len()) > self.max
            || self.declared.is_some_and(|declared| declared > self.max)
        {
            return Err(Refused::TooLarge);
        }
        while !data.is_empty() {
            let room = self
                .blocks
                .last()
                .map_or(0, |block| block.capacity() - block.len());
            if room == 0 {
                self.add_block(data.len())?;
                continue;
            }
            let n = room.min(data.len());
            let (now, rest) = data.split_at(n);
            if let Some(block) = self.blocks.last_mut() {
                block.extend_from_slice(now);
            }
            self.len += n;
            data = rest;
        }
        Ok(())
    }

    /// Adds an empty block: the rest of the declared length if the body
    /// declared one that holds `want` more bytes, else the rest of the
    /// allowance or the next [`BLOCK`]; paid for from the budget before it
    /// is allocated.
    fn add_block(&mut self, want: usize) -> Result<(), Refused> {
        let left = self.max - self.len;
        let size = match self.declared {
            Some(declared) if declared >= self.len + want => declared - self.len,
            // The allowance first, so a small body is never refused.
            _ if self.capacity < self.allowance => self.allowance - self.capacity,
            _ => BLOCK,
        }
        .min(left);
        let after = self.capacity + size;
        let counted =
            after.saturating_sub(self.allowance) - self.capacity.saturating_sub(self.allowance);
        if counted > 0 {
            let more = u32::try_from(counted)
                .ok()
                .and_then(|n| self.budget.clone().try_acquire_many_owned(n).ok())
                .ok_or(Refused::Busy)?;
            match &mut self.permit {
                Some(permit) => permit.merge(more),
                None => self.permit = Some(more),
            }
        }
        self.capacity = after;
        self.blocks.push(Vec::with_capacity(size));
        Ok(())
    }

    /// The body, and its share of the budget (to hold until it is
    /// answered). A body of several blocks is joined here, once.
    pub(crate) fn finish(mut self) -> (Bytes, Option<OwnedSemaphorePermit>) {
        let bytes = match self.blocks.len() {
            0 => Bytes::new(),
            1 => Bytes::from(self.blocks.swap_remove(0)),
            _ => Bytes::from(self.blocks.concat()),
        };
        (bytes, self.permit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALLOWANCE: usize = 16 << 10;

    fn budget(n: usize) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(n))
    }

    fn held(budget: &Semaphore, total: usize) -> usize {
        total - budget.available_permits()
    }

    /// R25: what a body holds in memory (its capacity) is what it takes
    /// from the budget, beyond the allowance; a body that grows by doubling
    /// never holds more than it paid for.
    #[test]
    fn r25_a_body_pays_for_its_capacity_not_only_its_bytes() {
        let total = 64 << 20;
        let budget = budget(total);
        let mut body = BodyBuffer::new(budget.clone(), ALLOWANCE, 8 << 20, None);
        for i in 0..40u8 {
            body.push(&[i; 65_000]).unwrap();
            let capacity: usize = body.blocks.iter().map(Vec::capacity).sum();
            assert!(capacity >= body.len && capacity < body.len.max(ALLOWANCE) + BLOCK);
            assert_eq!(capacity, body.capacity);
            assert_eq!(
                held(&budget, total),
                capacity.saturating_sub(ALLOWANCE),
                "the budget holds the buffers' capacity beyond the allowance"
            );
        }
        let (bytes, permit) = body.finish();
        assert_eq!(bytes.len(), 40 * 65_000);
        assert!(
            bytes
                .chunks(65_000)
                .zip(0u8..)
                .all(|(c, i)| c.iter().all(|&b| b == i)),
            "the blocks are joined in order"
        );
        drop(permit);
        assert_eq!(held(&budget, total), 0, "the budget is given back");
    }

    /// R25: a body that declares its length never holds more than it
    /// (nor more than the limit), however its frames arrive.
    #[test]
    fn r25_a_declared_length_caps_the_buffer() {
        let total = 64 << 20;
        let budget = budget(total);
        let length = (4 << 20) - 64;
        let mut body = BodyBuffer::new(budget.clone(), ALLOWANCE, 4 << 20, Some(length as u64));
        let chunk = vec![b' '; 64 << 10];
        let mut sent = 0;
        while sent < length {
            let n = chunk.len().min(length - sent);
            body.push(&chunk[..n]).unwrap();
            sent += n;
        }
        assert_eq!(body.blocks.len(), 1, "one buffer, never grown");
        assert_eq!(body.blocks[0].capacity(), length);
        assert_eq!(held(&budget, total), length - ALLOWANCE);
    }

    /// R25: a body that finds the budget spent is refused busy, and what it
    /// held stays held until it is dropped; a small body is never refused
    /// for lack of budget.
    #[test]
    fn r25_a_spent_budget_refuses_busy_and_small_bodies_still_pass() {
        let total = 1 << 20;
        let budget = budget(total);
        let mut big = BodyBuffer::new(budget.clone(), ALLOWANCE, 8 << 20, None);
        let chunk = vec![b'x'; 60 << 10];
        let refused = loop {
            if let Err(refused) = big.push(&chunk) {
                break refused;
            }
        };
        assert_eq!(refused, Refused::Busy);
        assert!(held(&budget, total) <= total);
        let mut small = BodyBuffer::new(budget.clone(), ALLOWANCE, 8 << 20, None);
        small.push(&[b'{'; 4096]).unwrap();
        small.push(&[b'}'; 4096]).unwrap();
        drop(big);
        assert_eq!(held(&budget, total), 0);
    }

    /// A body longer than it declared (which the HTTP layer refuses first)
    /// is still kept whole, in blocks after the declared buffer.
    #[test]
    fn a_body_longer_than_declared_is_kept_whole() {
        let total = 1 << 20;
        let budget = budget(total);
        let mut body = BodyBuffer::new(budget.clone(), ALLOWANCE, 1 << 20, Some(10));
        body.push(b"0123456789").unwrap();
        body.push(b"abc").unwrap();
        assert_eq!(body.capacity, ALLOWANCE);
        let (bytes, _permit) = body.finish();
        assert_eq!(&bytes[..], b"0123456789abc");
        assert_eq!(held(&budget, total), 0);
    }

    /// R31: over the limit is refused too large, declared or not; a body
    /// that declares a length over the limit at its first bytes.
    #[test]
    fn r31_past_the_limit_is_too_large() {
        let mut body = BodyBuffer::new(budget(1 << 30), ALLOWANCE, 100_000, Some(50));
        body.push(&[b' '; 50]).unwrap();
        assert_eq!(body.push(&[b' '; 100_000]), Err(Refused::TooLarge));
        let mut body = BodyBuffer::new(budget(1 << 30), ALLOWANCE, 100_000, None);
        assert_eq!(body.push(&[b' '; 100_001]), Err(Refused::TooLarge));
        let budget = budget(1 << 20);
        let mut body = BodyBuffer::new(budget.clone(), ALLOWANCE, 100_000, Some(100_001));
        assert_eq!(body.push(b"{"), Err(Refused::TooLarge));
        assert_eq!(budget.available_permits(), 1 << 20, "nothing held");
    }
}
