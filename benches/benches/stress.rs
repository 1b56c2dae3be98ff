//! `cargo bench`: the rayon stress suite of `src/lib.rs` (churn, handoff, handoff_msg,
//! prodcons, large, mixed, random_allocations, multi_stream, each with a touch variant, each in
//! the stream modes ptds, legacy and own) through the main binary, so both run the same code.
//! Arguments after `--` go to it, e.g.
//! `cargo bench -- --json --workloads churn --threads 1,16 --streams ptds,own`. Without any, it
//! runs `--quick`.

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    if args.is_empty() {
        args.push("--quick".into());
    }
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_cuarena"))
        .args(&args)
        .status()
        .expect("running the cuarena benchmark binary");
    std::process::exit(status.code().unwrap_or(1));
}
