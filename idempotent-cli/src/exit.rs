//! How a command ends: its exit code, and the message that says what went wrong and what to do.

use std::process::ExitCode;

/// The exit codes, documented in the crate docs and `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    /// 0: done.
    Ok = 0,
    /// 1: the store failed or could not be reached (a SQLite file that does not exist).
    Store = 1,
    /// 2: the command line is wrong (clap uses 2 as well), a key that several records' keys
    /// start with among them.
    Usage = 2,
    /// 3: no such record.
    NotFound = 3,
    /// 4: refused: the record is not as the command requires (another fence, another state,
    /// a live lease), or `doctor` found a problem.
    Refused = 4,
    /// 5: nothing changed: a destructive command ran without `--yes` and printed what it would do.
    DryRun = 5,
}

/// A command that did not do what it was asked, and why.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: Code,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Self {
        Failure { code, message: message.into() }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Failure::new(Code::Usage, message)
    }

    pub(crate) fn refused(message: impl Into<String>) -> Self {
        Failure::new(Code::Refused, message)
    }
}

impl From<idempotent_core::Error> for Failure {
    fn from(e: idempotent_core::Error) -> Self {
        let code = if matches!(e, idempotent_core::Error::Config(_)) { Code::Usage } else { Code::Store };
        Failure::new(code, e.to_string())
    }
}

impl From<Code> for ExitCode {
    fn from(code: Code) -> Self {
        ExitCode::from(code as u8)
    }
}
