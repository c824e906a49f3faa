//! How a run fared over every process that ran it, as `hypha-scheduler progress` shows it:
//! restarts, leases taken over, parameter-server failovers, workers lost, the last round
//! applied, and the latest of these with when they happened.
//!
//! The run's events are counted here as they happen; the counts are kept in the run's record,
//! so that a restarted scheduler goes on counting where its earlier process stopped.

use hypha_messages::iterate::{RunNote, RunProgress};

use crate::event::Event;

/// How many of the latest happenings a run's progress lists.
pub const RECENT: usize = 10;

/// How much of a happening's detail is kept: a lost worker's reason (a dial error, a job's
/// failure) can run to kilobytes.
const DETAIL_CHARS: usize = 200;

/// Counts `event`, which happened at `time_ms`, into `progress`.
pub fn tally(progress: &mut RunProgress, event: &Event, time_ms: u64) {
    let (kind, detail) = match event {
        Event::Resumed { round, jobs, .. } => {
            progress.restarts += 1;
            let from = match round {
                Some(round) => format!("from the checkpoint of round {round}"),
                None => "with no checkpoint".to_string(),
            };
            (
                "restart",
                format!("resumed {from}; {jobs} jobs to take over"),
            )
        }
        Event::Readopted {
            slot, peer, job, ..
        } => {
            progress.readoptions += 1;
            let how = match job {
                Some(_) => "with its job still running",
                None => "for a new job",
            };
            (
                "readoption",
                format!("slot {slot}: the lease on {peer} taken over {how}"),
            )
        }
        Event::Failover {
            peer,
            round,
            lost_rounds,
            standby,
            ..
        } => {
            progress.failovers += 1;
            (
                "failover",
                failover_note(peer, *round, *lost_rounds, standby.as_deref()),
            )
        }
        Event::Lost { slot, peer, reason } => {
            progress.lost += 1;
            ("lost", format!("slot {slot}: {peer}: {reason}"))
        }
        Event::Benched {
            slot,
            peer,
            round,
            reason,
            ..
        } => {
            progress.benched += 1;
            (
                "benched",
                format!("slot {slot}: {peer} benched at round {round}: {reason}"),
            )
        }
        Event::Refused {
            round,
            peer,
            reason,
        } => {
            progress.refused += 1;
            (
                "refused",
                format!("round {round}: {peer}'s update refused: {reason}"),
            )
        }
        // Counted, not listed: the centre holds an honest outlier back now and then, and
        // the latest happenings are for what a user must look at (the dashboard and the
        // events file list each clip).
        Event::Clipped { .. } => {
            progress.clipped += 1;
            return;
        }
        // Joining the first round is the run starting, not news.
        Event::Joined {
            slot, peer, round, ..
        } if *round > 0 => (
            "joined",
            format!("slot {slot}: {peer} joined at round {round}"),
        ),
        Event::RoundsBegin { late, waited_s, .. } if !late.is_empty() => (
            "late",
            format!(
                "rounds began without {} trainers still loading after {waited_s} s: {}",
                late.len(),
                late.join(", ")
            ),
        ),
        Event::Round { round, .. } => {
            progress.round = Some(*round);
            return;
        }
        Event::Evaluated {
            round,
            loss,
            accuracy,
            scored,
            ..
        } => {
            progress.held_out = Some(hypha_messages::diloco::Evaluation {
                round: *round,
                loss: *loss,
                scored: *scored,
                accuracy: *accuracy,
            });
            return;
        }
        _ => return,
    };
    if progress.recent.len() >= RECENT {
        progress.recent.drain(..=progress.recent.len() - RECENT);
    }
    progress.recent.push(RunNote {
        time_ms,
        kind: kind.to_string(),
        detail: printable(&detail),
    });
}

/// What a failover did: the server lost, who goes on from which round, what is trained again.
fn failover_note(peer: &str, round: u64, lost_rounds: u64, standby: Option<&str>) -> String {
    let after = match standby {
        Some(_) => "the round its standby holds",
        None => "its last checkpoint",
    };
    let lost = match lost_rounds {
        0 => String::new(),
        1 => format!(" (1 round after {after} is trained again)"),
        n => format!(" ({n} rounds after {after} are trained again)"),
    };
    let who = match standby {
        Some(standby) => format!("its standby {standby}"),
        None => "a new one".to_string(),
    };
    format!("parameter server {peer} lost; {who} goes on from round {round}{lost}")
}

/// `text` cut to [`DETAIL_CHARS`], control characters shown as U+FFFD: a reason can carry
/// what a worker sent, and it ends up on a terminal.
fn printable(text: &str) -> String {
    let mut shown: String = text
        .chars()
        .take(DETAIL_CHARS)
        .map(|c| if c.is_control() { '\u{FFFD}' } else { c })
        .collect();
    if text.chars().nth(DETAIL_CHARS).is_some() {
        shown.push('…');
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(slot: usize, reason: &str) -> Event {
        Event::Lost {
            slot,
            peer: "p".into(),
            reason: reason.into(),
        }
    }

    #[test]
    fn restarts_readoptions_failovers_and_losses_are_counted_and_the_latest_listed() {
        let mut progress = RunProgress::default();
        let events = [
            Event::Round {
                round: 3,
                trainers: 2,
                samples: 10,
                loss: None,
                away: false,
            },
            Event::Resumed {
                task: "t".into(),
                round: Some(3),
                jobs: 2,
            },
            Event::Readopted {
                slot: 1,
                peer: "w".into(),
                lease: 7,
                job: Some("j".into()),
            },
            Event::Failover {
                peer: "ps".into(),
                reason: "gone".into(),
                round: 4,
                lost_rounds: 2,
                standby: None,
            },
            lost(2, "gone"),
        ];
        for (at, event) in events.iter().enumerate() {
            tally(&mut progress, event, at as u64);
        }
        assert_eq!(
            (
                progress.restarts,
                progress.readoptions,
                progress.failovers,
                progress.lost,
                progress.round
            ),
            (1, 1, 1, 1, Some(3))
        );
        let kinds: Vec<(u64, &str)> = progress
            .recent
            .iter()
            .map(|n| (n.time_ms, n.kind.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                (1, "restart"),
                (2, "readoption"),
                (3, "failover"),
                (4, "lost")
            ]
        );
        assert_eq!(
            progress.recent[0].detail,
            "resumed from the checkpoint of round 3; 2 jobs to take over"
        );
        assert_eq!(
            progress.recent[1].detail,
            "slot 1: the lease on w taken over with its job still running"
        );
        assert_eq!(
            progress.recent[2].detail,
            "parameter server ps lost; a new one goes on from round 4 (2 rounds after its last checkpoint are trained again)"
        );
    }

    #[test]
    fn only_the_latest_are_kept_and_details_are_short_and_printable() {
        let mut progress = RunProgress::default();
        for at in 0..(RECENT as u64 + 5) {
            tally(&mut progress, &lost(0, "x"), at);
        }
        assert_eq!(progress.lost, RECENT as u32 + 5);
        assert_eq!(progress.recent.len(), RECENT);
        assert_eq!(progress.recent[0].time_ms, 5);

        tally(
            &mut progress,
            &lost(0, &format!("\x1b[2J{}", "y".repeat(500))),
            99,
        );
        let detail = &progress.recent[RECENT - 1].detail;
        assert!(!detail.contains('\x1b'), "{detail}");
        assert_eq!(detail.chars().count(), DETAIL_CHARS + 1);
        assert!(detail.ends_with('…'));
    }
}
