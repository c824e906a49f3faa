//! `POST /status/send`: the scheduler's answer, in both dialects.
//!
//! The body goes to the job's scheduler as it is. A DiLoCo trainer sends a
//! [`Status`](hypha_messages::diloco::Status) and is answered with a
//! [`TrainerOrder`](hypha_messages::diloco::TrainerOrder) (`{"action": "train", …}`); any
//! other status is answered `{"received": true}`. The bridge adds the upstream client's
//! `type` to every answer that has none ([`with_upstream_type`]), so that one answer serves
//! both: our fields for us, `type` (and `counter`) for the upstream client.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// What an answer means to the upstream client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AnswerType {
    /// Taken; nothing to do.
    Ok,
    /// Go on as you are (our `join` and `wait`).
    Continue,
    /// Send your update after `counter` more steps (our `train`: the batches left to the
    /// round's target).
    ScheduleUpdate,
    /// Training is over.
    Done,
    /// The scheduler refused the status.
    Error,
}

/// The answer to `POST /status/send`: the scheduler's JSON, with `type` added.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StatusAnswer {
    #[serde(rename = "type")]
    pub kind: AnswerType,
    /// With `ScheduleUpdate`: steps to take before sending the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counter: Option<u64>,
    /// The scheduler's own fields: `action` and its order's fields for a DiLoCo trainer
    /// (see `TrainerOrder`), `received` otherwise.
    #[serde(flatten)]
    pub scheduler: Map<String, Value>,
}

/// `answer` (the scheduler's JSON) with the upstream `type` added; `status` is what the
/// executor sent, whose `batches` turns a trainer's batch target into the steps left. An
/// answer that has a `type` already, or is not an object, is returned as it is.
pub fn with_upstream_type(answer: Value, status: &Value) -> Value {
    let Value::Object(scheduler) = answer else {
        return answer;
    };
    if scheduler.contains_key("type") {
        return Value::Object(scheduler);
    }
    let action = scheduler.get("action").and_then(Value::as_str);
    let (kind, counter) = match action {
        Some("done") => (AnswerType::Done, None),
        Some("train") => {
            let target = scheduler.get("batches").and_then(Value::as_u64);
            let done = status.get("batches").and_then(Value::as_u64).unwrap_or(0);
            (
                AnswerType::ScheduleUpdate,
                Some(target.unwrap_or(0).saturating_sub(done)),
            )
        }
        Some(_) => (AnswerType::Continue, None),
        None if scheduler.contains_key("error") => (AnswerType::Error, None),
        None => (AnswerType::Ok, None),
    };
    let answer = StatusAnswer {
        kind,
        counter,
        scheduler,
    };
    serde_json::to_value(answer).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn every_answer_gains_the_upstream_type_and_keeps_ours() {
        let trainer = json!({"diloco": "trainer", "round": 2, "batches": 5});
        let order = json!({"action": "train", "round": 2, "batches": 9, "parameter_server": "ps"});
        let answer = with_upstream_type(order, &trainer);
        assert_eq!(answer["type"], "ScheduleUpdate");
        assert_eq!(answer["counter"], 4);
        assert_eq!(answer["action"], "train");
        assert_eq!(answer["batches"], 9);
        // Past the target: sync now.
        let late = json!({"batches": 12});
        let order = json!({"action": "train", "round": 2, "batches": 9, "parameter_server": "ps"});
        assert_eq!(with_upstream_type(order, &late)["counter"], 0);

        let cases = [
            (json!({"action": "done"}), "Done"),
            (json!({"action": "wait", "retry_ms": 100}), "Continue"),
            (
                json!({"action": "join", "parameter_server": "ps"}),
                "Continue",
            ),
            (json!({"received": true}), "Ok"),
            (json!({"error": "no"}), "Error"),
        ];
        for (scheduler, kind) in cases {
            let answer = with_upstream_type(scheduler.clone(), &json!("update"));
            assert_eq!(answer["type"], kind, "{scheduler}");
            for (key, value) in scheduler.as_object().unwrap() {
                assert_eq!(&answer[key], value, "{scheduler}");
            }
        }
        // A scheduler that speaks the upstream dialect itself is left alone.
        let own = json!({"type": "Continue", "received": true});
        assert_eq!(with_upstream_type(own.clone(), &json!({})), own);
    }
}
