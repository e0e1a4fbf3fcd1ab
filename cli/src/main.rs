//! `tidemark`: one binary for every role. `tidemark sync` runs a coordinator and its workers in
//! one process, without etcd; `tidemark coordinator …` and `tidemark worker …` are the
//! cluster's processes (the same as `tidemark-coordinator` and `tidemark-worker`); the admin
//! commands (`status`, `tasks`, `shards`, …) are the coordinator's.

mod sync;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tidemark",
    version,
    about = "Tidemark: snapshot and incremental sync from operational databases into a target",
    after_help = "Admin commands (status, tasks, shards, workers, dead-letters, source, reconcile) \
                  reach a running coordinator: `tidemark status --coordinator http://…`; \
                  see `tidemark coordinator --help`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sync one table (or a config's tasks) in this process: no etcd, no control server.
    Sync(Box<sync::SyncArgs>),
    /// The cluster's coordinator (`serve`) and its admin commands.
    #[command(disable_help_flag = true)]
    Coordinator {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// The cluster's worker.
    #[command(disable_help_flag = true)]
    Worker {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    #[command(external_subcommand)]
    Admin(Vec<OsString>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Sync(args) => sync::main(*args),
        Command::Coordinator { args } => tidemark_coordinator::cli::main(
            "tidemark coordinator",
            std::iter::once(OsString::from("tidemark coordinator")).chain(args),
        ),
        Command::Worker { args } => tidemark_worker::cli::main(
            "tidemark worker",
            std::iter::once(OsString::from("tidemark worker")).chain(args),
        ),
        // `tidemark status …` is `tidemark coordinator status …`.
        Command::Admin(args) => {
            tidemark_coordinator::cli::main("tidemark", std::iter::once(OsString::from("tidemark")).chain(args))
        }
    }
}
