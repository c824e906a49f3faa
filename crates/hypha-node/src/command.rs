//! The subcommands every node program shares, and what each does.

use hypha_config::Schema;

use crate::{
    Error,
    args::{InitArgs, ProbeArgs, RunArgs},
    node, probe,
};

/// The subcommands every node program has, for its own command enum to flatten
/// (`#[command(flatten)] Node(NodeCommand)`); `Run` is its `run`'s flags. A program says what
/// its `run` does with `#[command(mut_subcommand("run", |run| run.about("…")))]`.
#[derive(Debug, Clone, clap::Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once, when the program starts
pub enum NodeCommand<Run: clap::Args = RunArgs> {
    /// Write a commented config file holding every key with its default.
    Init(InitArgs),
    /// Run the node.
    Run(Run),
    /// Check a node's health over the network; exit 0 healthy, 1 unhealthy or unreachable.
    Probe(ProbeArgs),
}

impl<Run: clap::Args> NodeCommand<Run> {
    /// Carries the command out: `init` writes the template of `schema`, `probe` reads its
    /// certificate settings as `probe_schema` says, and `run` is the program's own.
    pub async fn execute<F>(
        self,
        schema: &Schema,
        probe_schema: &Schema,
        run: impl FnOnce(Run) -> F,
    ) -> Result<(), Error>
    where
        F: std::future::Future<Output = Result<(), Error>>,
    {
        match self {
            NodeCommand::Init(args) => node::init(schema, &args),
            NodeCommand::Run(args) => run(args).await,
            NodeCommand::Probe(args) => probe::probe(probe_schema, &args).await,
        }
    }
}
