//! (in progress)
use crate::sched::Sched;
/// Options.
#[derive(Clone, Debug, Default)]
pub struct Options {}
/// Outcome.
#[derive(Clone, Debug)]
pub struct Outcome { /// best
 pub best: Sched }
/// Progress.
#[derive(Clone, Debug)]
pub struct Progress {}
/// optimize.
pub fn optimize() {}
