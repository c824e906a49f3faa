//! The worker's OpenTelemetry instruments (seed 003): jobs, leases, offers, the bytes jobs
//! send each other, and the data path (slices by source, bytes fetched, prefetch depth).
//!
//! Instruments come from the global meter provider, which telemetry sets up when metrics are
//! exported; otherwise they are no-ops.

use std::{sync::OnceLock, time::Duration};

use hypha_messages::job::JobStatus;
use opentelemetry::{
    KeyValue,
    metrics::{Counter, Histogram, Meter, UpDownCounter},
};

struct Instruments {
    jobs_active: UpDownCounter<i64>,
    jobs_started: Counter<u64>,
    jobs_ended: Counter<u64>,
    job_duration: Histogram<f64>,
    leases_active: UpDownCounter<i64>,
    lease_renewals: Counter<u64>,
    lease_expirations: Counter<u64>,
    offers: Counter<u64>,
    advertisements: Counter<u64>,
    resource_bytes: Counter<u64>,
    slices: Counter<u64>,
    slice_bytes: Counter<u64>,
    prefetch_depth: UpDownCounter<i64>,
}

fn meter() -> Meter {
    opentelemetry::global::meter("hypha-worker")
}

fn instruments() -> &'static Instruments {
    static INSTRUMENTS: OnceLock<Instruments> = OnceLock::new();
    INSTRUMENTS.get_or_init(|| {
        let m = meter();
        Instruments {
            jobs_active: m
                .i64_up_down_counter("hypha.worker.jobs.active")
                .with_description("Jobs whose executor is running")
                .build(),
            jobs_started: m
                .u64_counter("hypha.worker.jobs.started")
                .with_description("Jobs started")
                .build(),
            jobs_ended: m
                .u64_counter("hypha.worker.jobs.ended")
                .with_description("Jobs ended, by outcome (finished, failed) and exit code")
                .build(),
            job_duration: m
                .f64_histogram("hypha.worker.job.duration")
                .with_unit("s")
                .with_description("How long jobs ran")
                .build(),
            leases_active: m
                .i64_up_down_counter("hypha.worker.leases.active")
                .with_description("Leases held for schedulers (temporary and accepted)")
                .build(),
            lease_renewals: m
                .u64_counter("hypha.worker.lease.renewals")
                .with_description("Lease renewals, by result (ok, refused)")
                .build(),
            lease_expirations: m
                .u64_counter("hypha.worker.lease.expirations")
                .with_description("Leases that lapsed, by stage (temporary, accepted)")
                .build(),
            offers: m
                .u64_counter("hypha.worker.offers")
                .with_description("Offers sent to schedulers, by result (sent, failed)")
                .build(),
            advertisements: m
                .u64_counter("hypha.worker.advertisements")
                .with_description("Advertisements evaluated, by outcome (offered or why dropped)")
                .build(),
            slices: m
                .u64_counter("hypha.worker.data.slices")
                .with_description(
                    "Slices made ready for jobs, by source: cache (a cache hit) or network",
                )
                .build(),
            slice_bytes: m
                .u64_counter("hypha.worker.data.bytes")
                .with_unit("By")
                .with_description("Bytes of slices fetched from data nodes")
                .build(),
            prefetch_depth: m
                .i64_up_down_counter("hypha.worker.data.prefetch_depth")
                .with_description("Slices fetched and waiting for their executors")
                .build(),
            resource_bytes: m
                .u64_counter("hypha.worker.resources.bytes")
                .with_unit("By")
                .with_description(
                    "Bytes of resources moved between jobs, by direction (sent, received)",
                )
                .build(),
        }
    })
}

pub(crate) fn job_started() {
    let i = instruments();
    i.jobs_started.add(1, &[]);
    i.jobs_active.add(1, &[]);
}

pub(crate) fn job_ended(status: &JobStatus, duration: Duration) {
    let i = instruments();
    i.jobs_active.add(-1, &[]);
    let attributes = match status {
        JobStatus::Finished { exit_code, .. } => vec![
            KeyValue::new("outcome", "finished"),
            KeyValue::new("exit_code", i64::from(*exit_code)),
        ],
        JobStatus::Failed { .. } => vec![KeyValue::new("outcome", "failed")],
        JobStatus::Running => vec![KeyValue::new("outcome", "running")],
    };
    i.jobs_ended.add(1, &attributes);
    i.job_duration.record(duration.as_secs_f64(), &attributes);
}

pub(crate) fn leases_changed(delta: i64) {
    instruments().leases_active.add(delta, &[]);
}

pub(crate) fn lease_renewed(ok: bool) {
    instruments().lease_renewals.add(
        1,
        &[KeyValue::new("result", if ok { "ok" } else { "refused" })],
    );
}

pub(crate) fn lease_expired(accepted: bool) {
    instruments().lease_expirations.add(
        1,
        &[KeyValue::new(
            "stage",
            if accepted { "accepted" } else { "temporary" },
        )],
    );
}

pub(crate) fn offer_sent(ok: bool) {
    instruments().offers.add(
        1,
        &[KeyValue::new("result", if ok { "sent" } else { "failed" })],
    );
}

pub(crate) fn advertisement(outcome: &'static str) {
    instruments()
        .advertisements
        .add(1, &[KeyValue::new("outcome", outcome)]);
}

pub(crate) fn resource_bytes(direction: &'static str, bytes: u64) {
    instruments()
        .resource_bytes
        .add(bytes, &[KeyValue::new("direction", direction)]);
}

/// A slice was made ready for a job, from `source` ("cache" or "network").
pub fn slice_fetched(source: &'static str, bytes: u64) {
    let i = instruments();
    i.slices.add(1, &[KeyValue::new("source", source)]);
    if bytes > 0 {
        i.slice_bytes.add(bytes, &[]);
    }
}

/// Slices waiting for executors went up or down by `delta`.
pub fn prefetch_depth(delta: i64) {
    instruments().prefetch_depth.add(delta, &[]);
}
