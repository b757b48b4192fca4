//! Child processes that never outlive their test.

use std::process::Child;

/// Kills the child on drop if it is still running, even when the test panics: an orphaned worker
/// would keep connections to the test's database and break the next run's cleanup of it.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
