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

/// Why a scheduler's answer could not be passed on.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error("the scheduler's answer is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("the scheduler's answer is {0} bytes; answers are limited to {MAX_ANSWER_BYTES}")]
    TooLarge(usize),
}

/// The largest scheduler answer passed on to an executor: orders are a few hundred bytes.
pub const MAX_ANSWER_BYTES: usize = crate::MAX_BODY_BYTES;

/// `answer` (the scheduler's JSON) with the upstream `type` added; `status` is what the
/// executor sent, whose `batches` turns a trainer's batch target into the steps left. An
/// answer that has a `type` already, or is not an object, is passed on as it is. The
/// scheduler's own values are passed on byte for byte, never parsed into numbers and written
/// again.
pub fn with_upstream_type(answer: &str, status: &Value) -> Result<String, AnswerError> {
    if answer.len() > MAX_ANSWER_BYTES {
        return Err(AnswerError::TooLarge(answer.len()));
    }
    let parsed: Value = serde_json::from_str(answer).map_err(AnswerError::NotJson)?;
    let Value::Object(fields) = &parsed else {
        return Ok(answer.to_string());
    };
    if fields.contains_key("type") {
        return Ok(answer.to_string());
    }
    let action = fields.get("action").and_then(Value::as_str);
    let (kind, counter) = match action {
        Some("done") => (AnswerType::Done, None),
        Some("train") => {
            let target = fields.get("batches").and_then(Value::as_u64).unwrap_or(0);
            let done = status.get("batches").and_then(Value::as_u64).unwrap_or(0);
            (
                AnswerType::ScheduleUpdate,
                Some(target.saturating_sub(done)),
            )
        }
        Some(_) => (AnswerType::Continue, None),
        None if fields.contains_key("error") => (AnswerType::Error, None),
        None => (AnswerType::Ok, None),
    };
    // The object's own text, with `type` (and `counter`) added after its opening brace.
    let mut added = format!(
        "\"type\":{}",
        serde_json::to_string(&kind).map_err(AnswerError::NotJson)?
    );
    if let Some(counter) = counter {
        added.push_str(&format!(",\"counter\":{counter}"));
    }
    let body = answer.trim();
    let inner = &body[1..body.len() - 1];
    let separator = if fields.is_empty() { "" } else { "," };
    Ok(format!("{{{added}{separator}{inner}}}"))
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
        let answer = upstream(order, &trainer);
        assert_eq!(answer["type"], "ScheduleUpdate");
        assert_eq!(answer["counter"], 4);
        assert_eq!(answer["action"], "train");
        assert_eq!(answer["batches"], 9);
        // Past the target: sync now.
        let late = json!({"batches": 12});
        let order = json!({"action": "train", "round": 2, "batches": 9, "parameter_server": "ps"});
        assert_eq!(upstream(order, &late)["counter"], 0);

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
            let answer = upstream(scheduler.clone(), &json!("update"));
            assert_eq!(answer["type"], kind, "{scheduler}");
            for (key, value) in scheduler.as_object().unwrap() {
                assert_eq!(&answer[key], value, "{scheduler}");
            }
        }
        // A scheduler that speaks the upstream dialect itself is left alone.
        let own = json!({"type": "Continue", "received": true});
        assert_eq!(upstream(own.clone(), &json!({})), own);
        // Values pass byte for byte: a number beyond f64 stays as the scheduler wrote it.
        let precise = r#"{"received": true, "id": 123456789012345678901234567890}"#;
        let passed = with_upstream_type(precise, &json!({})).unwrap();
        assert!(
            passed.contains("123456789012345678901234567890"),
            "{passed}"
        );
        assert_eq!(
            with_upstream_type("{}", &json!({})).unwrap(),
            r#"{"type":"Ok"}"#
        );
        assert!(with_upstream_type("not json", &json!({})).is_err());
        let huge = format!("{{\"pad\": \"{}\"}}", "x".repeat(MAX_ANSWER_BYTES));
        assert!(matches!(
            with_upstream_type(&huge, &json!({})),
            Err(AnswerError::TooLarge(_))
        ));
    }

    fn upstream(answer: Value, status: &Value) -> Value {
        let text = with_upstream_type(&answer.to_string(), status).unwrap();
        serde_json::from_str(&text).unwrap()
    }
}
