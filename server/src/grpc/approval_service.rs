//! `ApprovalService`: approvers answer the approval requests guards' asks
//! made (R35). See [`crate::approval`].

use crate::decision_log::record::ApprovalAnswerRecord;
use crate::grpc::service::{door_trace, log_caller};
use crate::mesh::Mesh;
use guardmesh_proto::v1::approval_service_server::ApprovalService;
use guardmesh_proto::v1::{
    ApprovalListRequest, ApprovalListResponse, ApprovalState, ApproveRequest, ApproveResponse,
};
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// The most requests one `List` answers.
const MAX_LIST: u32 = 1000;

#[derive(Debug, Clone)]
pub(crate) struct Approvals {
    mesh: Arc<Mesh>,
}

impl Approvals {
    pub(crate) fn new(mesh: Arc<Mesh>) -> Self {
        Self { mesh }
    }
}

#[tonic::async_trait]
impl ApprovalService for Approvals {
    async fn approve(
        &self,
        request: Request<ApproveRequest>,
    ) -> Result<Response<ApproveResponse>, Status> {
        let approver = door_trace(&request).identity;
        let caller = log_caller(&self.mesh, &request);
        let ApproveRequest { id, approve, note } = request.into_inner();
        if note.len() > crate::approval::record::MAX_TEXT_BYTES {
            return Err(Status::invalid_argument(format!(
                "note: {} bytes, over {}",
                note.len(),
                crate::approval::record::MAX_TEXT_BYTES
            )));
        }
        // R29: the answer's record is written before the answer is
        // applied; a record that cannot be written (with `on_log_failure
        // = "refuse"`) leaves the request unanswered.
        let sessions = self.mesh.sessions();
        let approvals = &self.mesh.approvals;
        let answerable = crate::approval::answerable(sessions, approvals, &id, &approver).await;
        if let (Some(log), Some(caller)) = (self.mesh.decision_log(), caller) {
            let request = answerable.as_ref().ok().map(|a| a.request());
            let call = request.as_ref().and_then(|r| r.call.clone());
            let record = ApprovalAnswerRecord {
                caller: (*caller).clone(),
                request: id.chars().take(64).collect(),
                answer: if approve { "approve" } else { "deny" }.to_owned(),
                note: note.clone(),
                guard: request
                    .as_ref()
                    .map(|r| r.guard.clone())
                    .unwrap_or_default(),
                tool: call.map(|c| c.tool).unwrap_or_default(),
                digest: request
                    .as_ref()
                    .map(|r| r.digest.clone())
                    .unwrap_or_default(),
                session_id: request
                    .as_ref()
                    .map(|r| r.session_id.clone())
                    .unwrap_or_default(),
                outcome: match &answerable {
                    Ok(_) => "answered".to_owned(),
                    Err(status) => status.message().to_owned(),
                },
            };
            log.approval_before(record).await?;
        }
        let answered = match answerable {
            Ok(answerable) => {
                answerable
                    .apply(sessions, approvals, approve, &note, &approver)
                    .await
            }
            Err(status) => Err(status),
        };
        let request = answered?;
        tracing::info!(
            id = %request.id,
            guard = %request.guard,
            state = %ApprovalState::try_from(request.state).unwrap_or(ApprovalState::Unspecified),
            approver = %approver,
            "approval request answered"
        );
        Ok(Response::new(ApproveResponse {
            request: Some(request),
        }))
    }

    async fn list(
        &self,
        request: Request<ApprovalListRequest>,
    ) -> Result<Response<ApprovalListResponse>, Status> {
        let ApprovalListRequest {
            state,
            session_id,
            limit,
        } = request.into_inner();
        let state = ApprovalState::try_from(state)
            .map_err(|_| Status::invalid_argument(format!("state: no approval state {state}")))?;
        if limit > MAX_LIST {
            return Err(Status::invalid_argument(format!(
                "limit: {limit}, over {MAX_LIST}"
            )));
        }
        let limit = if limit == 0 { 100 } else { limit };
        let requests = crate::approval::list(
            self.mesh.sessions(),
            state,
            &session_id,
            usize::try_from(limit).unwrap_or(100),
        )
        .await?;
        Ok(Response::new(ApprovalListResponse { requests }))
    }
}
