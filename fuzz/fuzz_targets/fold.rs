//! The fold over arbitrary verdict sequences and arrival orders: whatever
//! arrives, junk included (verdicts for calls never sent, second verdicts,
//! verdicts after a guard ended), every call ends with exactly one
//! resolution (R2), and it equals judging the calls one by one in chain
//! order over what each guard finally said (R3, R4, R8, R13, R18).
#![no_main]

use guardmesh_proto::v1::{FailurePolicy, Skip};
use guardmesh_server::fuzzing::{Fold, FoldGuard, Resolution};
use libfuzzer_sys::fuzz_target;

#[derive(Clone, PartialEq)]
enum Cell {
    NotSent,
    Pending,
    Proceed,
    Skip,
    Failed,
}

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next().unwrap_or(0);
    let guards = 1 + usize::from(next() % 5);
    let calls = 1 + usize::from(next() % 6);
    let specs: Vec<FoldGuard> = (0..guards)
        .map(|_| {
            let b = next();
            FoldGuard {
                enforced: b & 1 == 0,
                policy: match (b >> 1) % 3 {
                    0 => FailurePolicy::FailClosed,
                    1 => FailurePolicy::FailOpen,
                    _ => FailurePolicy::Abort,
                },
            }
        })
        .collect();
    let mut cells: Vec<Vec<Cell>> = (0..guards)
        .map(|_| {
            (0..calls)
                .map(|_| {
                    if next() & 1 == 1 {
                        Cell::Pending
                    } else {
                        Cell::NotSent
                    }
                })
                .collect()
        })
        .collect();
    let sent: Vec<Vec<bool>> = cells
        .iter()
        .map(|row| row.iter().map(|c| *c == Cell::Pending).collect())
        .collect();
    let mut fold = Fold::new(specs.clone(), calls, |g, c| sent[g][c]);
    let events = usize::from(next() % 64);
    let apply =
        |fold: &mut Fold, cells: &mut Vec<Vec<Cell>>, op: u8, g: usize, c: usize| match op % 6 {
            0 | 1 => {
                let pending = cells[g][c] == Cell::Pending;
                assert_eq!(fold.answer(g, c, None), pending, "R8");
                if pending {
                    cells[g][c] = Cell::Proceed;
                }
            }
            2 | 3 => {
                let pending = cells[g][c] == Cell::Pending;
                let skip = Skip {
                    content: "no".into(),
                    kind: 0,
                };
                assert_eq!(fold.answer(g, c, Some(skip)), pending, "R8");
                if pending {
                    cells[g][c] = Cell::Skip;
                }
            }
            4 => {
                fold.complete(g);
                for cell in cells[g].iter_mut().filter(|c| **c == Cell::Pending) {
                    *cell = Cell::Proceed;
                }
            }
            _ => {
                fold.fail(g);
                for cell in cells[g].iter_mut().filter(|c| **c == Cell::Pending) {
                    *cell = Cell::Failed;
                }
            }
        };
    for _ in 0..events {
        let op = next();
        let g = usize::from(next()) % guards;
        let c = usize::from(next()) % calls;
        apply(&mut fold, &mut cells, op, g, c);
    }
    for g in 0..guards {
        let op = if next() & 1 == 1 { 5 } else { 4 };
        apply(&mut fold, &mut cells, op, g, 0);
    }
    assert!(fold.done());
    let mut aborts = Vec::new();
    for c in 0..calls {
        let mut want = Resolution::Proceed;
        for (g, guard) in specs.iter().enumerate() {
            match (&cells[g][c], guard.enforced, guard.policy) {
                (Cell::Pending, ..) => unreachable!("every guard ended"),
                (Cell::Skip, true, _) => want = Resolution::Skip(g),
                (Cell::Failed, true, FailurePolicy::FailClosed) => want = Resolution::FailClosed(g),
                (Cell::Failed, true, FailurePolicy::Abort) => want = Resolution::Abort(g),
                _ => continue,
            }
            break;
        }
        assert_eq!(fold.resolution(c), want, "call {c}");
        if let Resolution::Abort(g) = want {
            aborts.push(g);
        }
    }
    match fold.aborted_by() {
        None => assert!(aborts.is_empty()),
        Some(g) => assert!(aborts.contains(&g)),
    }
});
