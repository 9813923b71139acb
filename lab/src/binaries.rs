//! The binaries the lab starts as child processes: `tally`, whose `run` and `serve` the
//! benchmarks measure, and this binary itself, whose hidden `bench-baseline` runs each
//! baseline consumer in a process of its own.
//!
//! Children inherit no `TALLY_*` variable: they run with tally's defaults and the flags the
//! benchmark gives, whatever the shell that started the benchmark has set.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Where the `tally` binary is.
#[derive(Debug, Clone)]
pub struct Tally {
    path: PathBuf,
}

impl Tally {
    /// `--tally-bin` if given, else the `tally` beside this binary (cargo builds both into
    /// one directory of `target/`); fails when there is no file there.
    pub fn locate(flag: Option<PathBuf>) -> Result<Tally> {
        let path = match flag {
            Some(path) => path,
            None => std::env::current_exe()
                .context("locating the tally-lab binary")?
                .with_file_name("tally"),
        };
        if !path.is_file() {
            bail!(
                "no tally binary at {}: build it (cargo build --release -p tally) or give --tally-bin PATH",
                path.display()
            );
        }
        Ok(Tally { path })
    }

    /// A command for `tally`.
    pub fn command(&self) -> Command {
        without_settings(Command::new(&self.path))
    }

    /// A command for `tally`, kept on `cpus` (a `taskset -c` list) when given.
    pub fn command_on(&self, cpus: Option<&str>) -> Command {
        on_cpus(&self.path, cpus)
    }
}

/// A command for this same binary.
pub fn lab_command() -> Result<Command> {
    lab_command_on(None)
}

/// A command for this same binary, kept on `cpus` (a `taskset -c` list) when given.
pub fn lab_command_on(cpus: Option<&str>) -> Result<Command> {
    let path = std::env::current_exe().context("locating the tally-lab binary")?;
    Ok(on_cpus(&path, cpus))
}

/// A command for `program`, started by `taskset -c CPUS` when `cpus` is given: the process
/// and every thread it starts run only on those CPUs.
fn on_cpus(program: &Path, cpus: Option<&str>) -> Command {
    match cpus {
        Some(cpus) => {
            let mut command = Command::new("taskset");
            command.args(["-c", cpus]).arg(program);
            without_settings(command)
        }
        None => without_settings(Command::new(program)),
    }
}

/// `command` with every `TALLY_*` variable of this process removed.
fn without_settings(mut command: Command) -> Command {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TALLY_") {
            command.env_remove(name);
        }
    }
    command
}
