//! The bridge's OpenAPI 3.1 document, generated from this crate's types.
//!
//! [`document`] builds it: the endpoints are listed here, every schema is generated from the
//! type the bridge reads or writes. The committed `openapi.json` (what the worker serves at
//! `GET /openapi.json`, [`JSON`]) is checked against it by a test; after a change to the
//! types, `HYPHA_UPDATE_OPENAPI=1 cargo test -p hypha-bridge` rewrites it.

use hypha_messages::diloco::{Status, TrainerConfig, TrainerOrder};
use schemars::{JsonSchema, Schema, SchemaGenerator, generate::SchemaSettings};
use serde_json::{Value, json};

use crate::{
    ConsumedAnswer, ConsumedRequest, ErrorBody, FileEntry, JobDescription, ReceiveRequest,
    SendRequest, fetch::FetchBody, peers::StreamData, status::StatusAnswer,
};

/// The committed document, as the worker serves it.
pub const JSON: &str = include_str!("../openapi.json");

/// Where the committed document lives, relative to this crate.
pub const FILE: &str = "openapi.json";

const INFO: &str = "HTTP/1.1 over the job's Unix socket ({SOCKET_PATH}). Every path is relative to the job's work directory ({WORK_DIR}); absolute paths, '..' and symlinks leading out are refused with 403. Request bodies are limited to 1 MiB. Errors are JSON objects with a code and a message. Two dialects are read: seed 003's shapes and those of the upstream Hypha Python client (a bare reference as a fetch body; `resource` for `send` and `receive`, `path` for a receive's `out_dir`; strategies as objects; lower-case reference types); answers carry the fields of both.";

/// One endpoint.
struct Endpoint {
    path: &'static str,
    summary: &'static str,
    request: Option<Schema>,
    answer: &'static str,
    answer_type: &'static str,
    answer_schema: Schema,
    errors: &'static [u16],
}

/// The whole document.
pub fn document() -> Value {
    let mut generator: SchemaGenerator = SchemaSettings::draft2020_12()
        .with(|settings| settings.definitions_path = "/components/schemas".into())
        .into_generator();
    let mut schema = |f: fn(&mut SchemaGenerator) -> Schema| f(&mut generator);
    let endpoints = [
        Endpoint {
            path: "/resources/fetch",
            summary: "Download resources into the job's directory, take the next slice of its dataset, or wait for files peers sent",
            request: Some(schema(subschema::<FetchBody>)),
            answer: "The files written",
            answer_type: "application/json",
            answer_schema: schema(subschema::<Vec<FileEntry>>),
            errors: &[400, 403, 413, 501, 502, 503],
        },
        Endpoint {
            path: "/resources/send",
            summary: "Send a file to the jobs of this job's task on other workers",
            request: Some(schema(subschema::<SendRequest>)),
            answer: "The file sent; metadata.peers lists who took it",
            answer_type: "application/json",
            answer_schema: schema(subschema::<FileEntry>),
            errors: &[400, 403, 404, 413, 502],
        },
        Endpoint {
            path: "/resources/receive",
            summary: "Stream the files peers send to this job as Server-Sent Events",
            request: Some(schema(subschema::<ReceiveRequest>)),
            answer: "One event per file: `id: <sequence>` and `data: <ReceiveEvent>`. When a file cannot be put in out_dir: `event: error` and `data: <StreamError>`, told from a file by its `error` field. A request refused before the stream starts is answered with its 4xx status and, when it accepts `text/event-stream`, that one error event as the body.",
            answer_type: "text/event-stream",
            answer_schema: schema(subschema::<StreamData>),
            errors: &[400, 403, 413],
        },
        Endpoint {
            path: "/data/consumed",
            summary: "Tell the job's scheduler which slices went into which round, and which round reached the model",
            request: Some(schema(subschema::<ConsumedRequest>)),
            answer: "Slices the job may not count (it held them too long; another job has them now)",
            answer_type: "application/json",
            answer_schema: schema(subschema::<ConsumedAnswer>),
            errors: &[400, 413, 502],
        },
        Endpoint {
            path: "/status/send",
            summary: "Send a status to the job's scheduler and return its answer. A DiLoCo trainer sends a Status and is answered with a TrainerOrder; any other JSON is forwarded as it is and answered {\"received\": true}. Every answer also carries the upstream client's `type`.",
            request: Some(schema(status_request)),
            answer: "The scheduler's answer",
            answer_type: "application/json",
            answer_schema: schema(subschema::<StatusAnswer>),
            errors: &[400, 413, 502],
        },
        Endpoint {
            path: "/openapi.json",
            summary: "This document",
            request: None,
            answer: "OpenAPI 3.1",
            answer_type: "application/json",
            answer_schema: Schema::default(),
            errors: &[],
        },
    ];
    // Not answered by an endpoint, but part of the interface: the job's JSON, a DiLoCo
    // trainer's settings in its config and the DiLoCo orders inside a status answer.
    schema(subschema::<JobDescription>);
    schema(subschema::<TrainerConfig>);
    schema(subschema::<TrainerOrder>);
    schema(subschema::<ErrorBody>);
    let paths: serde_json::Map<String, Value> = endpoints
        .into_iter()
        .map(|endpoint| (endpoint.path.to_string(), endpoint.path_item()))
        .collect();
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Hypha job bridge",
            "version": "1.2.0",
            "description": INFO,
        },
        "paths": paths,
        "components": {
            "schemas": generator.take_definitions(true),
            "responses": {
                "Error": {
                    "description": "What went wrong",
                    "content": {
                        "application/json": {
                            "schema": { "$ref": "#/components/schemas/ErrorBody" }
                        }
                    }
                }
            }
        }
    })
}

impl Endpoint {
    /// The endpoint as an OpenAPI path item: a POST with a JSON body, or a GET without one.
    fn path_item(self) -> Value {
        let mut responses = serde_json::Map::new();
        responses.insert(
            "200".into(),
            json!({
                "description": self.answer,
                "content": { self.answer_type: { "schema": self.answer_schema } },
            }),
        );
        for status in self.errors {
            responses.insert(
                status.to_string(),
                json!({ "$ref": "#/components/responses/Error" }),
            );
        }
        let mut operation = json!({
            "summary": self.summary,
            "responses": responses,
        });
        let method = match self.request {
            Some(request) => {
                operation["requestBody"] = json!({
                    "required": true,
                    "content": { "application/json": { "schema": request } },
                });
                "post"
            }
            None => "get",
        };
        json!({ method: operation })
    }
}

fn subschema<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    generator.subschema_for::<T>()
}

/// A DiLoCo [`Status`], or any JSON a scheduler takes as it is.
fn status_request(generator: &mut SchemaGenerator) -> Schema {
    let diloco = generator.subschema_for::<Status>();
    schemars::json_schema!({
        "anyOf": [
            diloco,
            { "description": "Any other status: forwarded to the scheduler as it is." }
        ]
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The committed `openapi.json` is what the types say; `HYPHA_UPDATE_OPENAPI=1` rewrites
    /// it.
    #[test]
    fn the_committed_openapi_json_is_generated_from_the_types() {
        let generated = serde_json::to_string_pretty(&document()).unwrap() + "\n";
        if std::env::var_os("HYPHA_UPDATE_OPENAPI").is_some() {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(FILE);
            std::fs::write(&path, &generated).unwrap();
            return;
        }
        let committed: Value = serde_json::from_str(JSON).unwrap();
        assert!(
            committed == document(),
            "openapi.json differs from the bridge's types: run `HYPHA_UPDATE_OPENAPI=1 cargo test -p hypha-bridge` and commit it"
        );
    }
}
