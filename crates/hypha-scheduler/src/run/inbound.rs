//! What reaches a run from the network, and who may ask it what.

use std::{collections::HashSet, sync::Arc};

use hypha_messages::{
    Error as RemoteError, ErrorCode, Request, Response,
    diloco::{Order, Status},
    iterate::RunProgress,
    job::StatusReport,
};
use hypha_network::{InboundRequest, Network};
use libp2p::PeerId;
use serde::Deserialize;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinSet,
};

use crate::{allocator::Allocator, data::JobData};

/// Iterate and progress requests a scheduler answers at the same time.
pub(super) const ANSWERING: usize = 256;

/// An executor's status, from the worker `peer` for its job `job`, and where the run's answer
/// goes (dropped unanswered, the executor hears that it was received).
pub(super) struct ExecutorStatus {
    pub(super) peer: PeerId,
    pub(super) job: String,
    pub(super) report: ExecutorReport,
    pub(super) answer: oneshot::Sender<ExecutorAnswer>,
}

/// What an executor reported through its job bridge (`POST /status/send`).
pub(super) enum ExecutorReport {
    /// A DiLoCo trainer's, parameter server's or standby's status.
    Diloco(Box<Status>),
    /// Anything else an executor reports: any JSON document, recorded as it came.
    Other(serde_json::Value),
}

impl ExecutorReport {
    /// The report of `payload`: a DiLoCo status where it reads as one.
    fn of(payload: serde_json::Value) -> Self {
        match Status::deserialize(&payload) {
            Ok(status) => ExecutorReport::Diloco(Box::new(status)),
            Err(_) => ExecutorReport::Other(payload),
        }
    }

    /// The report as JSON, for the events file.
    pub(super) fn into_json(self) -> serde_json::Value {
        match self {
            ExecutorReport::Diloco(status) => {
                serde_json::to_value(*status).unwrap_or(serde_json::Value::Null)
            }
            ExecutorReport::Other(payload) => payload,
        }
    }
}

/// What a run answers an executor's status with.
pub(super) enum ExecutorAnswer {
    /// The order a DiLoCo status is answered with.
    Order(Order),
    /// Nobody has more to say: `{"received": true}`.
    Received,
}

impl From<Order> for ExecutorAnswer {
    fn from(order: Order) -> Self {
        ExecutorAnswer::Order(order)
    }
}

impl ExecutorAnswer {
    /// The answer as the executor reads it.
    fn to_json(&self) -> String {
        match self {
            // Its fields are strings, numbers and lists of them: it always serialises.
            ExecutorAnswer::Order(order) => serde_json::to_string(order).unwrap_or_default(),
            ExecutorAnswer::Received => RECEIVED.to_string(),
        }
    }
}

/// The (worker, job) pairs whose requests for data a run answers: its jobs, and jobs of an
/// earlier process being taken over. Anyone else (a job that ended, a peer that was never
/// leased) is refused, so that no one outside the run can hold or churn its slices.
#[derive(Debug, Clone, Default)]
pub(super) struct LiveJobs(Arc<std::sync::RwLock<HashSet<(PeerId, String)>>>);

impl LiveJobs {
    pub(super) fn insert(&self, peer: PeerId, job: &str) {
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert((peer, job.to_string()));
    }

    pub(super) fn remove(&self, peer: PeerId, job: &str) {
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(peer, job.to_string()));
    }

    pub(super) fn contains(&self, peer: PeerId, job: &str) -> bool {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(peer, job.to_string()))
    }

    /// Whether `peer` runs a job of the run.
    pub(super) fn runs_any(&self, peer: PeerId) -> bool {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|(p, _)| *p == peer)
    }
}

/// Who may ask a run for what: its live jobs for data, its workers and operators for its
/// progress.
#[derive(Debug, Clone)]
pub(super) struct Askers {
    pub(super) live: LiveJobs,
    pub(super) network: Network,
}

impl Askers {
    /// Whether `peer` may hear the run's progress, which names its task (whoever knows a task
    /// id can dispatch under it, and a worker refuses only a second scheduler, not the
    /// first): the run's workers and operators (certificates with the `operator` role) may.
    pub(super) fn may_watch(&self, peer: PeerId) -> bool {
        self.live.runs_any(peer)
            || self
                .network
                .roles(&peer)
                .is_some_and(|roles| roles.contains(hypha_network::Role::Operator))
    }
}

/// What an executor status is answered with when nobody has more to say.
const RECEIVED: &str = r#"{"received":true}"#;

/// Answers what reaches a scheduler from the network: offers go to the allocator, job
/// statuses to `statuses`, executor statuses to `executor_statuses`, whose answer goes back
/// to the executor; progress requests get the iteration's counts and the run's `history`, if
/// the asking peer [`may watch`](Askers::may_watch) the run. Answers still on their way are
/// dropped with the returned future.
pub(super) async fn route_inbound(
    mut inbound: mpsc::Receiver<InboundRequest>,
    allocator: Allocator,
    statuses: mpsc::Sender<(PeerId, StatusReport)>,
    executor_statuses: mpsc::Sender<ExecutorStatus>,
    data: Option<JobData>,
    history: watch::Receiver<RunProgress>,
    askers: Askers,
) {
    // Iterate and progress requests wait for the ledger: they are answered concurrently, at
    // most ANSWERING at once; the inbound queue fills behind them.
    let answering = Arc::new(tokio::sync::Semaphore::new(ANSWERING));
    let mut answers = JoinSet::new();
    while let Some(request) = inbound.recv().await {
        while answers.try_join_next().is_some() {}
        let peer = request.peer;
        if let (Request::Iterate(_) | Request::Progress { .. }, Some(data)) =
            (&request.request, &data)
        {
            let Ok(permit) = answering.clone().acquire_owned().await else {
                break;
            };
            let service = data.service().clone();
            let history = history.clone();
            let askers = askers.clone();
            answers.spawn(async move {
                let response = match &request.request {
                    Request::Iterate(iterate) if !askers.live.contains(peer, &iterate.consumer) => {
                        Err(RemoteError::new(
                            ErrorCode::Gone,
                            format!("{} is not a running job of this run", iterate.consumer),
                        ))
                    }
                    Request::Iterate(iterate) => {
                        service.iterate(&peer, iterate).await.map(Response::Iterate)
                    }
                    _ if !askers.may_watch(peer) => Err(RemoteError::new(
                        ErrorCode::Forbidden,
                        "a run's progress names its task, so a scheduler tells it only to the run's workers and to operators; ask with a certificate issued with `hypha-certutil node --role operator`",
                    )),
                    _ => service.progress().await.map(|progress| {
                        Response::Progress(hypha_messages::iterate::IterationProgress {
                            run: Some(Box::new(history.borrow().clone())),
                            ..progress
                        })
                    }),
                };
                let _ = request
                    .responder
                    .respond(response.unwrap_or_else(Response::Error))
                    .await;
                drop(permit);
            });
            continue;
        }
        let response = match request.request {
            Request::Offer(offer) => {
                if allocator.offer_arrived(peer, offer) {
                    Response::Ack
                } else {
                    Response::Error(RemoteError::new(
                        ErrorCode::Gone,
                        "that advertisement is closed",
                    ))
                }
            }
            Request::JobStatus(report) => match statuses.try_send((peer, report)) {
                Ok(()) => Response::Ack,
                Err(_) => Response::Error(RemoteError::new(ErrorCode::Busy, "try again")),
            },
            Request::ExecutorStatus { job, payload } => {
                match serde_json::from_str::<serde_json::Value>(&payload) {
                    Ok(payload) => {
                        let (answer_tx, answer) = oneshot::channel();
                        let status = ExecutorStatus {
                            peer,
                            job,
                            report: ExecutorReport::of(payload),
                            answer: answer_tx,
                        };
                        if executor_statuses.try_send(status).is_err() {
                            Response::Error(RemoteError::new(ErrorCode::Busy, "try again"))
                        } else {
                            // The job's loop answers; the router goes on meanwhile.
                            answers.spawn(async move {
                                let payload = answer
                                    .await
                                    .map_or_else(|_| RECEIVED.to_string(), |a| a.to_json());
                                let _ = request
                                    .responder
                                    .respond(Response::ExecutorStatus { payload })
                                    .await;
                            });
                            continue;
                        }
                    }
                    Err(e) => Response::Error(RemoteError::new(
                        ErrorCode::BadRequest,
                        format!("the status is not JSON: {e}"),
                    )),
                }
            }
            _ => Response::Error(RemoteError::new(
                ErrorCode::Unsupported,
                "schedulers answer health, offers, job statuses and, for jobs with data, iterate and progress requests",
            )),
        };
        let _ = request.responder.respond(response).await;
    }
}

#[cfg(test)]
mod tests {
    use hypha_messages::diloco::{Order, ServerOrder, Status, TrainerOrder};

    use super::{ExecutorAnswer, ExecutorReport};

    /// What executors send through their bridge: a DiLoCo status reads as one, anything else
    /// is kept as it came; answers go on the wire as the order alone (as before the types),
    /// or `{"received":true}`.
    #[test]
    fn executor_statuses_are_read_typed_and_answered_in_their_wire_format() {
        let trainer = serde_json::json!({"diloco": "trainer", "round": 3, "batches": 10});
        let ExecutorReport::Diloco(status) = ExecutorReport::of(trainer) else {
            panic!("a trainer's status is a DiLoCo status");
        };
        assert!(matches!(*status, Status::Trainer(ref s) if s.round == Some(3) && s.batches == 10));
        let other = serde_json::json!({"step": 5, "loss": 0.25});
        assert!(
            matches!(ExecutorReport::of(other.clone()), ExecutorReport::Other(v) if v == other)
        );
        let wait = ExecutorAnswer::from(Order::Trainer(TrainerOrder::wait(200)));
        assert_eq!(wait.to_json(), r#"{"action":"wait","retry_ms":200}"#);
        let close = ExecutorAnswer::from(Order::ParameterServer(ServerOrder::Close {
            round: 4,
            send_to: vec!["peer".into()],
        }));
        assert_eq!(
            close.to_json(),
            r#"{"action":"close","round":4,"send_to":["peer"]}"#
        );
        assert_eq!(ExecutorAnswer::Received.to_json(), r#"{"received":true}"#);
    }
}
