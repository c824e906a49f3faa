//! The human-facing commands of `hypha-data`: `prepare`, `inspect`, `verify`, `fetch`,
//! `iterate`, `progress`, `audit`.

use std::{io::IsTerminal, path::PathBuf};

use hypha_dataset::{Dataset, verify};
use hypha_node::{Error, Overrides};

use crate::DataClient;

/// `hypha-data prepare`.
#[derive(Debug, Clone, clap::Args)]
pub struct PrepareArgs {
    /// The input: a .npy file, a directory of .npy files, a .safetensors file, text (a .jsonl
    /// file, a UTF-8 text file, or a directory of them, walked recursively), or a folder of
    /// images with one sub-folder per class.
    pub input: PathBuf,
    /// The dataset directory to create; its name is the dataset's name.
    #[arg(short, long)]
    pub output: PathBuf,
    /// What the input is (default: decided from the input).
    #[arg(long, value_enum, default_value_t = InputKind::Auto)]
    pub kind: InputKind,
    /// Samples per slice.
    #[arg(long, default_value_t = 1024)]
    pub slice_size: u64,
    /// Text: tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub sequence_length: usize,
    /// Text: the JSON field holding each document.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Text: a Hugging Face tokenizer.json to tokenise with (default: byte-level tokens).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Images: width and height after resizing.
    #[arg(long, default_value_t = 64)]
    pub image_size: u32,
    /// Store slices as plain .safetensors instead of Snappy-compressed.
    #[arg(long)]
    pub plain: bool,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Replace the output directory if it exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InputKind {
    Auto,
    Arrays,
    Text,
    Images,
}

/// Builds a dataset from `args.input`.
pub fn prepare(args: &PrepareArgs) -> Result<(), Error> {
    use hypha_dataset::prepare::{self as p, arrays::Arrays, images::Images, text::Text};
    let bad = |e: p::PrepareError| Error::BadInput(e.to_string());
    let kind = match args.kind {
        InputKind::Auto => guess_kind(&args.input)?,
        other => other,
    };
    let source: Box<dyn p::Source> = match kind {
        InputKind::Arrays => Box::new(Arrays::open(&args.input).map_err(bad)?),
        InputKind::Text => Box::new(
            Text::open(
                &args.input,
                &args.text_field,
                args.sequence_length,
                args.tokenizer.as_deref(),
            )
            .map_err(bad)?,
        ),
        InputKind::Images => Box::new(Images::open(&args.input, args.image_size).map_err(bad)?),
        InputKind::Auto => unreachable!("resolved above"),
    };
    let mut options = p::Options {
        slice_size: args.slice_size,
        force: args.force,
        ..p::Options::default()
    };
    if args.plain {
        options.encoding = hypha_dataset::slice::Encoding::Plain;
    }
    if let Some(threads) = args.threads {
        options.threads = threads;
    }
    let bar = if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(source.samples()).with_message("preparing");
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {pos}/{len} samples {per_sec} eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let manifest = p::write_dataset(source.as_ref(), &args.output, &options, &|done| {
        bar.set_position(done)
    })
    .map_err(|e| match e {
        p::PrepareError::Io { .. } => Error::Failed(e.to_string()),
        other => Error::BadInput(other.to_string()),
    })?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {} slices, {} samples, {} ({} decompressed)",
        args.output.display(),
        manifest.slices.len(),
        manifest.samples(),
        human_bytes(manifest.size()),
        human_bytes(manifest.uncompressed_size())
    );
    Ok(())
}

/// Text files by their extension, when guessing what a directory holds.
const TEXT_EXTENSIONS: [&str; 6] = ["jsonl", "json", "txt", "text", "md", "rst"];

fn guess_kind(input: &std::path::Path) -> Result<InputKind, Error> {
    let extension_of = |path: &std::path::Path| {
        path.extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
    };
    match extension_of(input).as_deref() {
        Some("npy" | "safetensors") => return Ok(InputKind::Arrays),
        Some(text) if TEXT_EXTENSIONS.contains(&text) => return Ok(InputKind::Text),
        _ => {}
    }
    if input.is_dir() {
        let entries: Vec<_> = std::fs::read_dir(input)
            .map_err(|e| Error::BadInput(format!("{}: {e}", input.display())))?
            .filter_map(Result::ok)
            .collect();
        let has = |extension: &str| {
            entries
                .iter()
                .any(|e| extension_of(&e.path()).as_deref() == Some(extension))
        };
        if has("npy") {
            return Ok(InputKind::Arrays);
        }
        if TEXT_EXTENSIONS.iter().any(|extension| has(extension)) {
            return Ok(InputKind::Text);
        }
        if entries
            .iter()
            .any(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        {
            return Ok(InputKind::Images);
        }
    }
    Err(Error::BadInput(format!(
        "{}: cannot tell what this input is; pass --kind arrays, text or images",
        input.display()
    )))
}

/// Describes a dataset: slices, samples, sizes, compression, tensor schema.
pub fn inspect(path: &std::path::Path) -> Result<(), Error> {
    let dataset = open(path)?;
    let manifest = dataset.manifest();
    let size = manifest.size();
    let uncompressed = manifest.uncompressed_size();
    println!("dataset      {}", manifest.name);
    println!("path         {}", dataset.root().display());
    println!("slices       {}", manifest.slices.len());
    println!("samples      {}", manifest.samples());
    println!("on disk      {}", human_bytes(size));
    println!("decompressed {}", human_bytes(uncompressed));
    if size > 0 {
        println!("compression  {:.2}×", uncompressed as f64 / size as f64);
    }
    for (slice, count) in manifest.schemas() {
        println!("schema of {count} slice(s):");
        for t in &slice.tensors {
            println!("  {:<20} {:<5} {:?}", t.name, t.dtype, t.shape);
        }
    }
    Ok(())
}

/// `hypha-data verify`.
#[derive(Debug, Clone, clap::Args)]
pub struct VerifyArgs {
    /// The dataset directory.
    pub path: PathBuf,
    /// Where a data node stored the manifest of this dataset if its directory is read-only
    /// (the node's `manifest_dir`; default: $XDG_STATE_HOME/hypha/manifests, else
    /// ~/.local/state/hypha/manifests).
    #[arg(long)]
    pub manifest_dir: Option<PathBuf>,
}

/// Checks every slice against the stored manifest (the dataset's `manifest.json`, or the one
/// a data node stored for it); names each damaged slice on its own `BAD` line, checks all the
/// others, and fails if there is one. Without a stored manifest every slice is decoded
/// instead, which finds truncated and undecodable slices but cannot see a changed value.
pub fn verify_dataset(args: &VerifyArgs) -> Result<(), Error> {
    let path = &args.path;
    let external = args
        .manifest_dir
        .clone()
        .or_else(hypha_dataset::default_manifest_dir)
        .map(|dir| hypha_dataset::external_manifest_path(&dir, path));
    let stored =
        Dataset::stored(path, external.as_deref()).map_err(|e| Error::BadInput(e.to_string()))?;
    let (count, mut bad, checked_against) = match &stored {
        Some(dataset) => {
            let manifest = dataset.manifest();
            let bar = progress_bar(manifest.size(), "verifying");
            let problems = verify(dataset, |entry| bar.inc(entry.size));
            bar.finish_and_clear();
            let mut bad: Vec<String> = problems.iter().map(ToString::to_string).collect();
            let unlisted = hypha_dataset::unlisted_files(dataset)
                .map_err(|e| Error::BadInput(e.to_string()))?;
            bad.extend(unlisted.iter().map(|file| {
                format!(
                    "{file}: not in the manifest (added after it was written); run `hypha-data prepare` again, or delete the manifest to have it derived"
                )
            }));
            let source = match dataset.source() {
                hypha_dataset::ManifestSource::Stored(path) => path.display().to_string(),
                _ => "its manifest".into(),
            };
            (manifest.slices.len(), bad, Some(source))
        }
        None => {
            let size = hypha_dataset::slice_files(path)
                .map_err(|e| Error::BadInput(e.to_string()))?
                .iter()
                .filter_map(|f| std::fs::metadata(path.join(f)).ok())
                .map(|m| m.len())
                .sum();
            let bar = progress_bar(size, "decoding");
            let (count, problems) = hypha_dataset::check_decodes(path, |bytes| bar.inc(bytes))
                .map_err(|e| Error::BadInput(e.to_string()))?;
            bar.finish_and_clear();
            (
                count,
                problems.iter().map(ToString::to_string).collect(),
                None,
            )
        }
    };
    bad.sort_by(|a, b| hypha_dataset::slice_order(a, b));
    for line in &bad {
        println!("BAD  {line}");
    }
    let name = stored
        .as_ref()
        .map_or_else(|| path.display().to_string(), |d| d.name().to_string());
    match &checked_against {
        Some(manifest) if bad.is_empty() => {
            println!("ok   {count} slices of {name} match {manifest}");
        }
        Some(_) => {}
        None => {
            if bad.is_empty() {
                println!("ok   {count} slices of {name} decode");
            }
            println!(
                "note: {name} has no stored manifest, so hashes could not be checked (a flipped bit that still decodes passes); `hypha-data prepare` writes one, and a data node stores one the first time it serves the dataset"
            );
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Error::Failed(format!(
            "{} of {count} slices are damaged; restore them from another copy or prepare the dataset again",
            bad.len()
        )))
    }
}

fn open(path: &std::path::Path) -> Result<Dataset, Error> {
    Dataset::open(path).map_err(|e| Error::BadInput(e.to_string()))
}

/// `hypha-data fetch`.
#[derive(Debug, Clone, clap::Args)]
pub struct FetchArgs {
    /// The dataset's name, as announced in the DHT.
    #[arg(long)]
    pub dataset: String,
    /// The slice's index (0-based, in the dataset's numeric order).
    #[arg(long)]
    pub slice: u64,
    /// Where to write the slice (default: <dataset>-<slice>.safetensors).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Write the bytes as the node stores them (raw Snappy for datasets made by the seed
    /// recipe) instead of a plain SafeTensors file.
    #[arg(long)]
    pub raw: bool,
    /// A config file for the certificate and gateways (a data node's config works).
    #[arg(short, long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: Overrides,
}

/// How long `fetch` looks for providers before giving up.
/// The providers of `dataset`, and its manifest from the first of them that sends it.
async fn find_dataset(
    client: &DataClient,
    dataset: &str,
) -> Result<(Vec<hypha_network::PeerId>, hypha_dataset::Manifest), Error> {
    let failed = |e: crate::FetchError| Error::Failed(e.to_string());
    // A data node that has just started may not have announced itself yet: look for a while.
    let deadline = tokio::time::Instant::now() + PROVIDER_WAIT;
    let providers = loop {
        match client.providers(dataset).await {
            Ok(providers) => break providers,
            Err(crate::FetchError::NoProviders { .. })
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Err(e) => return Err(failed(e)),
        }
    };
    let mut reasons = Vec::new();
    for peer in &providers {
        match client.manifest(*peer, dataset).await {
            Ok(manifest) => return Ok((providers, manifest)),
            Err(e) => reasons.push(e.to_string()),
        }
    }
    Err(Error::Failed(format!(
        "none of the {} providers of {dataset:?} sent its manifest: {}",
        providers.len(),
        reasons.join("; ")
    )))
}

const PROVIDER_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Finds the dataset's providers, fetches the manifest and the slice, verifies it, writes it.
pub async fn fetch(args: &FetchArgs) -> Result<(), Error> {
    let schema = crate::node::client_schema();
    let network = hypha_node::start_client(
        "fetch",
        &schema,
        args.config.as_deref(),
        &args.overrides,
        true,
    )
    .await?;
    let result = fetch_with(&DataClient::new(network.clone()), args).await;
    network.shutdown().await;
    result
}

async fn fetch_with(client: &DataClient, args: &FetchArgs) -> Result<(), Error> {
    let failed = |e: crate::FetchError| Error::Failed(e.to_string());
    let (providers, manifest) = find_dataset(client, &args.dataset).await?;
    let entry = usize::try_from(args.slice)
        .ok()
        .and_then(|i| manifest.slices.get(i))
        .ok_or_else(|| {
            Error::BadInput(format!(
                "--slice {}: {:?} has slices 0..{}",
                args.slice,
                args.dataset,
                manifest.slices.len()
            ))
        })?;
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}-{}.safetensors", args.dataset, args.slice)));
    let limit = hypha_dataset::slice::MAX_SLICE_BYTES as u64;
    if entry.size > limit || entry.uncompressed_size > limit {
        return Err(Error::Failed(format!(
            "slice {} of {:?} is {} bytes ({} decompressed) by its manifest, more than the {limit} a slice may have",
            args.slice, args.dataset, entry.size, entry.uncompressed_size
        )));
    }
    let mut bytes = Vec::new();
    let report = client
        .fetch_slice_to_vec(&args.dataset, entry, &providers, &mut bytes)
        .await
        .map_err(failed)?;
    let (encoding, plain) = hypha_dataset::slice::decode(&bytes).map_err(|e| {
        Error::Failed(format!(
            "slice {} of {:?} matches its manifest but is not a slice: {e}",
            args.slice, args.dataset
        ))
    })?;
    let (written, form) = match (args.raw, encoding) {
        (false, hypha_dataset::slice::Encoding::Snappy) => (&plain[..], "decompressed"),
        (true, hypha_dataset::slice::Encoding::Snappy) => (&bytes[..], "raw Snappy"),
        (_, hypha_dataset::slice::Encoding::Plain) => (&bytes[..], "plain"),
    };
    hypha_files::write_atomic(&output, written, hypha_files::Mode::Public, true)
        .map_err(|e| Error::Failed(format!("{}: {e}", output.display())))?;
    println!(
        "wrote {} ({}, {form} SafeTensors, BLAKE3 verified) from {}",
        output.display(),
        human_bytes(written.len() as u64),
        report.provider
    );
    Ok(())
}

fn progress_bar(total: u64, message: &'static str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total).with_message(message);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `hypha-data iterate`.
#[derive(Debug, Clone, clap::Args)]
pub struct IterateArgs {
    /// The dataset's name, as announced in the DHT.
    #[arg(long)]
    pub dataset: String,
    /// The iteration: clients that name the same one share it, and each slice of each epoch
    /// goes to exactly one of them. A data node keeps its iterations across restarts.
    #[arg(long, default_value = "default")]
    pub iteration: String,
    /// Epochs the iteration runs (fixed by whoever starts it; later clients must agree).
    #[arg(long, default_value_t = 1)]
    pub epochs: u32,
    /// Fixes each epoch's order (fixed by whoever starts the iteration).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The data node to iterate (a peer ID); default: the first provider found.
    #[arg(long)]
    pub node: Option<String>,
    /// Slices asked for at a time.
    #[arg(long, default_value_t = 4)]
    pub batch: u32,
    /// Stop after this many slices (default: until the iteration is done).
    #[arg(long)]
    pub limit: Option<u64>,
    /// Download each slice, verified, into this directory as e{epoch}-{file}.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// This client's name in the iteration (default: a random one). A client that restarts
    /// under the same name picks up the slices it held.
    #[arg(long)]
    pub client: Option<String>,
    /// A peer (its ID) that may iterate this iteration too. The iteration belongs to the
    /// peer (certificate) that starts it: other peers are refused unless its owner names
    /// them. Repeat for several; the owner's latest list counts.
    #[arg(long = "share-with", value_name = "PEER_ID")]
    pub share_with: Vec<String>,
    /// A config file for the certificate and gateways (a data node's config works).
    #[arg(short, long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: Overrides,
}

/// Iterates a data node's own slices (`cluster_sync = false`): asks the node for slices in
/// batches, downloads each when asked to, reports it consumed with the next request, and
/// prints one line per slice: `epoch E slice S samples N [path]`.
pub async fn iterate(args: &IterateArgs) -> Result<(), Error> {
    if args.batch == 0 {
        return Err(Error::BadInput(
            "--batch 0: ask for at least one slice at a time".into(),
        ));
    }
    let schema = crate::node::client_schema();
    let network = hypha_node::start_client(
        "iterate",
        &schema,
        args.config.as_deref(),
        &args.overrides,
        true,
    )
    .await?;
    let result = iterate_with(&DataClient::new(network.clone()), &network, args).await;
    network.shutdown().await;
    result
}

async fn iterate_with(
    client: &DataClient,
    network: &hypha_network::Network,
    args: &IterateArgs,
) -> Result<(), Error> {
    use hypha_messages::iterate::{IterateRequest, IterateStatus};

    let (providers, manifest) = find_dataset(client, &args.dataset).await?;
    let node = match &args.node {
        Some(node) => {
            let node: hypha_network::PeerId = node
                .parse()
                .map_err(|e| Error::BadInput(format!("--node {node:?} is not a peer ID: {e}")))?;
            if !providers.contains(&node) {
                return Err(Error::Failed(format!(
                    "{node} does not announce {:?}; its providers are {}",
                    args.dataset,
                    providers
                        .iter()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            node
        }
        None => providers[0],
    };
    if let Some(dir) = &args.output {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::BadInput(format!("--output {}: {e}", dir.display())))?;
    }
    let consumer = args
        .client
        .clone()
        .unwrap_or_else(|| format!("iterate-{}", &uuid_like()));
    let mut consumed = Vec::new();
    let mut taken = 0u64;
    loop {
        let remaining = args.limit.map_or(u64::MAX, |limit| limit - taken);
        let want = u64::from(args.batch).min(remaining) as u32;
        let request = IterateRequest {
            iteration: args.iteration.clone(),
            dataset: args.dataset.clone(),
            consumer: consumer.clone(),
            epochs: args.epochs,
            seed: args.seed,
            want,
            cached: Vec::new(),
            consumed: std::mem::take(&mut consumed),
            round: 0,
            completed_round: None,
            holding: None,
            share_with: args.share_with.clone(),
        };
        let grant = crate::iteration::ask(network, node, request)
            .await
            .map_err(|e| Error::Failed(e.to_string()))?;
        for refused in &grant.refused {
            eprintln!(
                "warning: epoch {} slice {} was taken by another client while this one held it",
                refused.epoch, refused.slice
            );
        }
        if want == 0 {
            return Ok(());
        }
        for slice in &grant.slices {
            let entry = usize::try_from(slice.slice)
                .ok()
                .and_then(|i| manifest.slices.get(i))
                .ok_or_else(|| {
                    Error::Failed(format!(
                        "{node} granted slice {} of a dataset with {} slices",
                        slice.slice,
                        manifest.slices.len()
                    ))
                })?;
            let mut line = format!(
                "epoch {} slice {} samples {}",
                slice.epoch, slice.slice, slice.samples
            );
            if let Some(dir) = &args.output {
                let dest = dir.join(format!("e{}-{}", slice.epoch, entry.file));
                client
                    .fetch_slice(&args.dataset, entry, &[node], &dest)
                    .await
                    .map_err(|e| Error::Failed(e.to_string()))?;
                line.push(' ');
                line.push_str(&dest.display().to_string());
            }
            println!("{line}");
            consumed.push(slice.key());
            taken += 1;
        }
        match grant.status {
            IterateStatus::Granted => {}
            IterateStatus::Wait { retry_ms } => {
                tokio::time::sleep(std::time::Duration::from_millis(retry_ms)).await;
            }
            IterateStatus::Finished => return Ok(()),
        }
    }
}

/// Eight hex digits from the clock and the process ID: enough to tell concurrent clients apart.
fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{:08x}", nanos ^ std::process::id().rotate_left(16))
}

/// `progress`: where an iteration stands, asked of the node that runs its ledger.
#[derive(Debug, Clone, clap::Args)]
pub struct ProgressArgs {
    #[command(flatten)]
    pub node: hypha_node::ProbeArgs,
    /// The iteration (a data node's iterations have names; a scheduler answers for the one it
    /// runs whatever is given).
    #[arg(long, default_value = "")]
    pub iteration: String,
    /// Print the answer as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Asks the node at `args.node.address` where an iteration stands and prints it: per epoch the
/// slices available, assigned, consumed and used; per consumer its share and pace.
pub async fn progress(schema: &hypha_config::Schema, args: &ProgressArgs) -> Result<(), Error> {
    use hypha_messages::{Request, Response};

    let address: hypha_network::Multiaddr = args.node.address.parse().map_err(|e| {
        Error::BadInput(format!(
            "address {:?}: {e}; write it like /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...",
            args.node.address
        ))
    })?;
    let network = hypha_node::start_client(
        "progress",
        schema,
        args.node.config.as_deref(),
        &args.node.overrides,
        false,
    )
    .await?;
    let ask = async {
        let peer = network.dial(address.clone()).await?;
        network
            .request(
                peer,
                Request::Progress {
                    iteration: args.iteration.clone(),
                },
            )
            .await
    };
    let outcome =
        tokio::time::timeout(std::time::Duration::from_secs(args.node.timeout), ask).await;
    network.shutdown().await;
    let progress = match outcome {
        Err(_) => {
            return Err(Error::Failed(format!(
                "{address}: no answer within {} s",
                args.node.timeout
            )));
        }
        Ok(Err(e)) => return Err(Error::Failed(format!("{address}: unreachable: {e}"))),
        Ok(Ok(Response::Progress(progress))) => progress,
        Ok(Ok(Response::Error(e))) => {
            return Err(Error::Failed(format!("{address}: {}", e.message)));
        }
        Ok(Ok(other)) => {
            return Err(Error::Failed(format!(
                "{address} answered {other:?} to a progress request"
            )));
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&progress).map_err(|e| Error::Failed(e.to_string()))?
        );
        return Ok(());
    }
    println!(
        "iteration {} of {:?}: {}",
        progress.iteration,
        progress.dataset,
        if progress.finished {
            "finished"
        } else {
            "running"
        }
    );
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>10}",
        "epoch", "available", "assigned", "consumed", "used"
    );
    for e in &progress.epochs {
        println!(
            "{:>6} {:>10} {:>10} {:>10} {:>10}",
            e.epoch, e.available, e.assigned, e.consumed, e.used
        );
    }
    if !progress.consumers.is_empty() {
        println!(
            "{:<60} {:>8} {:>8} {:>8} {:>9} {:>10}",
            "consumer", "assigned", "consumed", "used", "slices/s", "samples/s"
        );
        for c in &progress.consumers {
            println!(
                "{:<60} {:>8} {:>8} {:>8} {:>9.2} {:>10.1}",
                c.consumer, c.assigned, c.consumed, c.used, c.slices_per_s, c.samples_per_s
            );
        }
    }
    if let Some(run) = &progress.run {
        for line in run_lines(run, hypha_messages::unix_ms()) {
            println!("{line}");
        }
    }
    Ok(())
}

/// A scheduler's run in lines: how often it was restarted, took leases over, replaced its
/// parameter server or lost workers, and how long before `now_ms` the latest of these
/// happened.
fn run_lines(run: &hypha_messages::iterate::RunProgress, now_ms: u64) -> Vec<String> {
    let mut round = run.round.map_or_else(
        || "no round applied yet".to_string(),
        |r| format!("last round applied {r}"),
    );
    if let Some(eval) = &run.held_out {
        round += &format!(
            "; held-out loss {:.4} of the model of round {}",
            eval.loss, eval.round
        );
    }
    let mut lines = vec![format!(
        "run {}: restarts {}, leases taken over {}, parameter-server failovers {}, workers lost {}, trainers benched {}, updates refused {}, clipped {}; {round}",
        run.task,
        run.restarts,
        run.readoptions,
        run.failovers,
        run.lost,
        run.benched,
        run.refused,
        run.clipped
    )];
    lines.extend(run.recent.iter().map(|note| {
        let ago = now_ms.saturating_sub(note.time_ms) / 1000;
        format!("{ago:>8} s ago  {:<10} {}", note.kind, note.detail)
    }));
    lines
}

#[cfg(test)]
mod tests {
    use hypha_messages::iterate::{RunNote, RunProgress};

    use super::*;

    #[test]
    fn a_run_shows_its_counts_and_how_long_ago_the_latest_happenings_were() {
        let run = RunProgress {
            task: "t1".into(),
            restarts: 1,
            readoptions: 3,
            failovers: 2,
            lost: 4,
            benched: 1,
            refused: 5,
            clipped: 6,
            round: Some(7),
            held_out: Some(hypha_messages::diloco::Evaluation {
                round: 6,
                loss: 1.25,
                scored: 100,
                accuracy: None,
            }),
            recent: vec![RunNote {
                time_ms: 10_000,
                kind: "failover".into(),
                detail: "parameter server p lost".into(),
            }],
        };
        let lines = run_lines(&run, 52_500);
        assert_eq!(
            lines,
            [
                "run t1: restarts 1, leases taken over 3, parameter-server failovers 2, workers lost 4, trainers benched 1, updates refused 5, clipped 6; last round applied 7; held-out loss 1.2500 of the model of round 6",
                "      42 s ago  failover   parameter server p lost",
            ]
        );
        let fresh = RunProgress::default();
        assert!(run_lines(&fresh, 0)[0].ends_with("no round applied yet"));
    }
}

/// `audit`: exactly-once, checked from a ledger file's audit log alone.
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// The ledger file: a scheduler's (`[data] ledger` of the job file, by default beside it
    /// and named after it) or a data node's (`<iteration_dir>/<dataset>/<iteration>.ledger`).
    /// No running node may hold it open.
    pub ledger: PathBuf,
    /// Print every transition too, in the order the ledger recorded them.
    #[arg(long)]
    pub transitions: bool,
    /// Check the iteration as finished even if its last epoch is not used up: every slice of
    /// every epoch must have been used (say so when the job that ran it ended).
    #[arg(long)]
    pub finished: bool,
    /// Print the report as JSON (with `--transitions`, the transitions as well).
    #[arg(long)]
    pub json: bool,
}

/// Prints a ledger's every transition, one a line, as `audit --transitions` shows them.
/// Names come from the file: escaped, so that a name cannot steer the terminal.
fn print_transitions(records: &[hypha_ledger::AuditRecord]) {
    use hypha_ledger::Event;

    let start = records.first().map_or(0, |r| r.time_ms);
    println!(
        "{:>8} {:>10} {:>6} {:>8}  event",
        "#", "seconds", "epoch", "slice"
    );
    for record in records {
        let event = match &record.event {
            Event::Assigned { worker, .. } => {
                format!("assigned to {}", worker.escape_debug())
            }
            Event::Consumed { worker, round } => {
                format!("consumed by {} in round {round}", worker.escape_debug())
            }
            Event::Used { worker, round } => {
                format!("USED by {} in round {round}", worker.escape_debug())
            }
            Event::Returned { worker, reason } => {
                format!("returned by {}: {reason:?}", worker.escape_debug())
            }
        };
        println!(
            "{:>8} {:>10.3} {:>6} {:>8}  {event}",
            record.seq,
            record.time_ms.saturating_sub(start) as f64 / 1000.0,
            record.key.epoch,
            record.key.slice
        );
    }
}

/// Reads a ledger's audit log, prints per epoch and worker where its slices stand, and fails
/// (exit 1) when a slice was used twice in an epoch, or when the iteration is finished (its
/// last epoch used up, or `--finished`) and a slice was never used.
pub fn audit(args: &AuditArgs) -> Result<(), Error> {
    use hypha_ledger::Finished;

    let audit = hypha_ledger::read_audit(&args.ledger).map_err(|e| match e {
        hypha_ledger::Error::Missing(_) | hypha_ledger::Error::InUse(_) => {
            Error::BadInput(e.to_string())
        }
        e => Error::Failed(format!("{}: {e}", args.ledger.display())),
    })?;
    let report = audit.check(if args.finished {
        Finished::Yes
    } else {
        Finished::WhenLastEpochIsUsed
    });
    if args.json {
        let mut json = serde_json::to_value(&report).map_err(|e| Error::Failed(e.to_string()))?;
        json["exactly_once"] = report.exactly_once().into();
        if args.transitions {
            json["transitions_log"] =
                serde_json::to_value(&audit.records).map_err(|e| Error::Failed(e.to_string()))?;
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&json).map_err(|e| Error::Failed(e.to_string()))?
        );
    } else {
        // Names come from the file: escaped, so that a name cannot steer the terminal.
        if args.transitions {
            print_transitions(&audit.records);
        }
        println!(
            "ledger {}: iteration {} of {:?}, {} epoch(s) of {} slices, {} transitions",
            args.ledger.display(),
            report.token,
            report.dataset,
            report.epochs.len(),
            report.slices,
            report.transitions
        );
        println!(
            "{:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "epoch", "available", "assigned", "consumed", "used", "returned"
        );
        for e in &report.epochs {
            println!(
                "{:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
                e.epoch, e.available, e.assigned, e.consumed, e.used, e.returned
            );
        }
        println!(
            "{:<60} {:>8} {:>8} {:>8} {:>8}",
            "worker", "assigned", "consumed", "used", "returned"
        );
        for w in &report.workers {
            println!(
                "{:<60} {:>8} {:>8} {:>8} {:>8}",
                w.worker.escape_debug().to_string(),
                w.assigned,
                w.consumed,
                w.used,
                w.returned
            );
        }
        for problem in &report.problems {
            println!("BAD  {problem}");
        }
        if report.unlisted_problems > 0 {
            println!("BAD  and {} more", report.unlisted_problems);
        }
    }
    let state = if report.finished {
        "finished"
    } else {
        "not finished"
    };
    match report.problems.first() {
        None => {
            if !args.json {
                println!(
                    "ok   exactly once: no slice was used twice{} (the iteration is {state})",
                    if report.finished {
                        ", every slice of every epoch was used"
                    } else {
                        ""
                    }
                );
            }
            Ok(())
        }
        Some(first) => Err(Error::Failed(format!(
            "exactly-once does not hold in {} ({state}): {} problem(s), the first: {first}",
            args.ledger.display(),
            report.problems.len()
        ))),
    }
}
