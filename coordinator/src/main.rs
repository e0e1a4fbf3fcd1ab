use std::process::ExitCode;

fn main() -> ExitCode {
    tidemark_coordinator::cli::main("tidemark-coordinator", std::env::args_os())
}
