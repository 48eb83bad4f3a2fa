//! `guardmesh config check FILE` and `guardmesh config reference`: a config
//! file checked without starting a mesh, and every key it may hold. Both
//! come from the server's key table (`guardmesh_server::config::keys`),
//! the one the loader checks files against.

use guardmesh_server::config::check::{self, Files, Finding, Severity};
use guardmesh_server::config::keys;
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit codes of `guardmesh config check`, for scripts.
pub(crate) const EXIT_CODES_HELP: &str = "Exit codes: 0 the file is valid (warnings may be \
    printed); 1 it is not: a syntax, key or value error, or a policy, certificate, key or token \
    file it names that is missing, unreadable or does not parse; 2 the check could not run (the \
    config file cannot be read, or a usage error).";

#[derive(clap::Args)]
pub(crate) struct ConfigArgs {
    #[command(subcommand)]
    action: ConfigAction,
}

#[derive(clap::Subcommand)]
enum ConfigAction {
    /// Checks a config file without starting a mesh: reports every error
    /// with its line, its key and what to write instead, and reads the
    /// policy files, certificates, keys and tokens it names. Relative paths
    /// are relative to the config file's folder.
    #[command(after_help = EXIT_CODES_HELP)]
    Check {
        file: PathBuf,
        /// Reads the files the config names under DIR, as if DIR were the
        /// root of the file system the mesh runs on: `/etc/guardmesh/x`
        /// is read as `DIR/etc/guardmesh/x` (a ConfigMap's files checked
        /// in CI). Relative paths stay relative to the config's folder.
        #[arg(long, value_name = "DIR", conflicts_with = "no_files")]
        root: Option<PathBuf>,
        /// Does not read the files the config names: checks the keys and
        /// values, not the files nor what needs their contents.
        #[arg(long)]
        no_files: bool,
    },
    /// Prints every key of the config file with its type, default and
    /// meaning.
    Reference {
        /// Markdown, as docs/configuration.md.
        #[arg(long)]
        markdown: bool,
    },
}

/// Runs `guardmesh config ...`.
pub(crate) fn main(args: ConfigArgs) -> ExitCode {
    match args.action {
        ConfigAction::Reference { markdown } => {
            let text = if markdown {
                keys::reference_markdown()
            } else {
                keys::reference_text()
            };
            out!("{text}");
            ExitCode::SUCCESS
        }
        ConfigAction::Check {
            file,
            root,
            no_files,
        } => match check::check_file_with(&file, &files(root, no_files)) {
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::from(2)
            }
            Ok(findings) => report(&file.display().to_string(), &findings),
        },
    }
}

fn files(root: Option<PathBuf>, no_files: bool) -> Files {
    match (root, no_files) {
        (_, true) => Files::Skip,
        (Some(root), false) => Files::Root(root),
        (None, false) => Files::AsWritten,
    }
}

/// Prints the findings, one per paragraph, and a summary line; the exit
/// code says whether any is an error.
fn report(file: &str, findings: &[Finding]) -> ExitCode {
    let mut errors = 0;
    let mut warnings = 0;
    for finding in findings {
        let severity = match finding.severity {
            Severity::Error => {
                errors += 1;
                "error"
            }
            Severity::Warning => {
                warnings += 1;
                "warning"
            }
        };
        let place = finding
            .line
            .map_or_else(|| file.to_owned(), |line| format!("{file}:{line}"));
        let key = if finding.key.is_empty() {
            String::new()
        } else {
            format!(" {}:", finding.key)
        };
        outln!("{place}: {severity}:{key} {}", finding.message);
        if !finding.fix.is_empty() {
            outln!("    fix: {}", finding.fix);
        }
    }
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    if errors == 0 {
        outln!("{file}: valid ({})", plural(warnings, "warning"));
        ExitCode::SUCCESS
    } else {
        outln!(
            "{file}: invalid ({}, {})",
            plural(errors, "error"),
            plural(warnings, "warning")
        );
        ExitCode::FAILURE
    }
}
