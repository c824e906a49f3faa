//! `hypha-worker fetch`: one artifact fetched by hand, shared with every other node fetching it
//! at the same time, with a live view of where its chunks come from.
//!
//! It joins the network with the worker's config (certificates, gateways, `[artifacts]`),
//! fetches, keeps serving its chunks until every other member of the swarm has them all (or
//! `--linger` passes), and prints a JSON summary on stdout.

use std::{
    io::IsTerminal,
    path::PathBuf,
    time::{Duration, Instant},
};

use hypha_artifacts::{Distributor, FetchOptions, Origins, Progress, Request};
use hypha_messages::artifact::{Kind, Unpack, UnpackMethod};
use hypha_node::{Error, Node, RunArgs};
use tokio::sync::watch;

use crate::config::{WorkerConfig, schema};

/// Fetch one artifact (an object, or every object under a prefix) from a configured origin.
#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// The origin profile in [artifacts.profiles].
    #[arg(long, default_value = hypha_messages::artifact::DEFAULT_PROFILE)]
    pub profile: String,
    /// URI names a prefix: fetch every object under it, the tree kept.
    #[arg(long)]
    pub prefix: bool,
    /// Also unpack the archive (tar, tar.gz, zip; by name or content) into this directory.
    #[arg(long, value_name = "DIR")]
    pub unpack: Option<PathBuf>,
    /// How many nodes (this one included) fetch the same artifact now; each waits up to
    /// artifacts.join_timeout_ms for the others, so that every chunk is read from the origin
    /// once. 0: start at once.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub expect: usize,
    /// After the fetch, keep serving chunks until every other node has them all, or this many
    /// seconds pass.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub linger: u64,
    /// The object's key (or the prefix) relative to the profile's url.
    pub uri: String,
    /// Where the object is written; for a prefix, the directory that receives the tree.
    pub destination: PathBuf,
}

/// What `fetch` prints on stdout when it is done.
#[derive(Debug, serde::Serialize)]
struct Summary {
    /// The whole artifact id (the progress's `artifact` is its first 12 hex digits).
    id: String,
    files: Vec<PathBuf>,
    unpacked: Option<PathBuf>,
    from_cache: bool,
    seconds: f64,
    /// This node's view after lingering: uploads include what peers pulled meanwhile.
    #[serde(flatten)]
    progress: Progress,
}

/// Runs `hypha-worker fetch`.
pub async fn run(args: &FetchArgs) -> Result<(), Error> {
    let loaded = hypha_node::load_run_config(&schema(), &args.run)?;
    let config = WorkerConfig::from_loaded(&loaded)?;
    let here = std::env::current_dir().map_err(|e| Error::Failed(e.to_string()))?;
    let request = Request {
        profile: args.profile.clone(),
        uri: args.uri.clone(),
        kind: if args.prefix {
            Kind::Prefix
        } else {
            Kind::Object
        },
        destination: args.destination.clone(),
        unpack: args.unpack.clone().map(|destination| Unpack {
            destination,
            method: UnpackMethod::Auto,
        }),
    }
    .resolved_against(&here);
    let node = Node::start_with("worker", loaded, |_| {}).await?;
    let distributor = Distributor::start(
        node.network.clone(),
        Origins::new(config.artifacts.profiles.clone()),
        &config.artifacts.dir,
        config.artifacts.settings.clone(),
    )
    .map_err(|e| {
        Error::Failed(format!(
            "{e} (a worker running with the same artifacts.dir holds it: stop it, or pass --set artifacts.dir=ANOTHER_DIR)"
        ))
    })?;
    let (progress_tx, progress_rx) = watch::channel(Progress::default());
    let view = tokio::spawn(show(progress_rx));
    let started = Instant::now();
    let fetched = distributor
        .fetch(
            &request,
            &FetchOptions {
                expect: args.expect,
                progress: Some(progress_tx),
                // Every node's operator asked for this artifact by hand.
                admission: None,
            },
        )
        .await;
    let _ = view.await;
    let fetched = fetched.map_err(|e| Error::Failed(e.to_string()))?;
    let seconds = started.elapsed().as_secs_f64();
    if !distributor.settle(Duration::from_secs(args.linger)).await {
        tracing::info!(
            linger_s = args.linger,
            "stopped serving before every peer had the whole artifact"
        );
    }
    let progress = distributor
        .progress(fetched.artifact)
        .map(|p| p.borrow().clone())
        .unwrap_or(fetched.progress);
    distributor.leave_all();
    let summary = Summary {
        id: fetched.artifact.to_string(),
        files: fetched.files,
        unpacked: fetched.unpacked,
        from_cache: fetched.from_cache,
        seconds,
        progress,
    };
    println!(
        "{}",
        serde_json::to_string_pretty(&summary).unwrap_or_default()
    );
    node.network.shutdown().await;
    Ok(())
}

/// Draws the live view on stderr (when it is a terminal) until the fetch ends.
async fn show(mut progress: watch::Receiver<Progress>) {
    let bar = if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(0);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} chunks {msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut rate = Rate::default();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            changed = progress.changed() => if changed.is_err() { break },
            _ = tick.tick() => {}
        }
        let p = progress.borrow().clone();
        bar.set_prefix(p.artifact.clone());
        bar.set_length(u64::from(p.chunks));
        bar.set_position(u64::from(p.held));
        bar.set_message(describe(&p, rate.update(p.origin_bytes + p.peer_bytes)));
        if p.complete || p.failure().is_some() {
            break;
        }
    }
    bar.finish();
}

/// One line: where this node's chunks came from, what it sent, and the other members.
fn describe(p: &Progress, bytes_per_second: f64) -> String {
    let done = p.peers.iter().filter(|m| m.done).count();
    let banned = p.peers.iter().filter(|m| m.banned).count();
    let mut line = format!(
        "| origin {} | peers {} | uploaded {} | {:.1} MiB/s | {} members, {done} done",
        p.origin_chunks,
        p.peer_chunks,
        p.uploaded_chunks,
        bytes_per_second / f64::from(1 << 20),
        p.peers.len() + 1,
    );
    if p.resumed_chunks > 0 {
        line.push_str(&format!(" | resumed {}", p.resumed_chunks));
    }
    if banned > 0 {
        line.push_str(&format!(" | {banned} banned"));
    }
    line
}

/// Receive rate over the last few seconds.
#[derive(Debug, Default)]
struct Rate {
    samples: std::collections::VecDeque<(Instant, u64)>,
}

impl Rate {
    const WINDOW: Duration = Duration::from_secs(3);

    fn update(&mut self, bytes: u64) -> f64 {
        let now = Instant::now();
        self.samples.push_back((now, bytes));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Self::WINDOW)
        {
            self.samples.pop_front();
        }
        match (self.samples.front(), self.samples.back()) {
            (Some((t0, b0)), Some((t1, b1))) if t1 > t0 => {
                b1.saturating_sub(*b0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use hypha_artifacts::PeerProgress;

    use super::*;

    #[test]
    fn the_view_names_every_source_and_the_members() {
        let member = |done, banned| PeerProgress {
            peer: hypha_network::PeerId::random(),
            held: 3,
            done,
            banned,
        };
        let mut progress = Progress::default();
        progress.origin_chunks = 4;
        progress.peer_chunks = 9;
        progress.uploaded_chunks = 7;
        progress.resumed_chunks = 2;
        progress.peers = vec![
            member(true, false),
            member(false, false),
            member(false, true),
        ];
        assert_eq!(
            describe(&progress, 3.0 * f64::from(1 << 20)),
            "| origin 4 | peers 9 | uploaded 7 | 3.0 MiB/s | 4 members, 1 done | resumed 2 | 1 banned"
        );
    }

    #[test]
    fn the_rate_is_measured_over_the_last_samples() {
        let mut rate = Rate::default();
        assert_eq!(rate.update(0), 0.0);
        std::thread::sleep(Duration::from_millis(50));
        let measured = rate.update(1 << 20);
        // 1 MiB in a little over 50 ms.
        assert!(
            measured > 5.0 * f64::from(1 << 20) && measured <= 21.0 * f64::from(1 << 20),
            "{measured}"
        );
    }
}
