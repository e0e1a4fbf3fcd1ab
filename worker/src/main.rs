use std::process::ExitCode;

fn main() -> ExitCode {
    tidemark_worker::cli::main("tidemark-worker", std::env::args_os())
}
