//! Tasks: background tasks whose panic ends the process.
//!
//! Invariant: every task tally spawns beside its main loop (the generation
//! and registry followers, the probes, the HTTP listener, hot-post sharing,
//! a rebuild's heartbeat) is spawned through [`spawn`], and a panic in any of
//! them is reported to [`failed`], which the binary awaits beside its
//! command and turns into one line and a non-zero exit. A follower that
//! stopped following would leave a process that looks alive and writes with
//! a stale view; a dead process is better, since the fences make a restart
//! exact. The panic still reaches the task's `JoinHandle`, so a caller that
//! awaits one sees it as before.
//!
//! The panic's location comes from [`install_panic_hook`], which also keeps
//! the default hook's multi-line report off stderr for supervised tasks (the
//! one line says it all); panics anywhere else are reported as before.

use std::cell::Cell;
use std::future::Future;
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A supervised task that panicked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "background task {task} panicked{}: {message}; exiting so that a restart resumes from the fences",
    location.as_deref().map(|l| format!(" at {l}")).unwrap_or_default()
)]
pub struct Failure {
    /// The task's name.
    pub task: &'static str,
    /// Where it panicked (file:line:column), when the hook was installed.
    pub location: Option<String>,
    /// The panic's message.
    pub message: String,
}

thread_local! {
    /// Nesting depth of supervised polls on this thread.
    static SUPERVISED: Cell<u32> = const { Cell::new(0) };
    /// The location of the last panic in a supervised poll on this thread.
    static LOCATION: Cell<Option<String>> = const { Cell::new(None) };
}

fn failures() -> &'static watch::Sender<Option<Failure>> {
    static FAILURES: OnceLock<watch::Sender<Option<Failure>>> = OnceLock::new();
    FAILURES.get_or_init(|| watch::channel(None).0)
}

/// The task named here panics on its first poll: for tests of supervision.
static INJECTED: OnceLock<String> = OnceLock::new();

/// Makes the task called `name` panic when it first runs (testing only).
pub fn inject_panic(name: &str) {
    let _ = INJECTED.set(name.to_string());
}

/// Installs a panic hook that records where a supervised task panicked
/// instead of printing it; other panics go to the hook installed before.
pub fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
        if SUPERVISED.with(Cell::get) > 0 {
            let location = info.location().map(ToString::to_string);
            LOCATION.with(|l| l.set(location));
        } else {
            previous(info);
        }
    }));
}

/// Resolves with the first supervised task that panicked.
pub async fn failed() -> Failure {
    let mut receiver = failures().subscribe();
    let seen = receiver
        .wait_for(Option::is_some)
        .await
        .expect("the sender is static");
    seen.clone().expect("waited for a failure")
}

/// Spawns `future` on the runtime, supervised: a panic is reported to
/// [`failed`] (the first one wins) and then resumes, so the handle sees it.
pub fn spawn<F>(task: &'static str, future: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(Supervised {
        task,
        future: Box::pin(future),
        polled: false,
    })
}

struct Supervised<F> {
    task: &'static str,
    future: Pin<Box<F>>,
    polled: bool,
}

impl<F: Future> Future for Supervised<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let inject = !this.polled && INJECTED.get().is_some_and(|name| name == this.task);
        this.polled = true;
        SUPERVISED.with(|depth| depth.set(depth.get() + 1));
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if inject {
                panic!("injected failure");
            }
            this.future.as_mut().poll(cx)
        }));
        SUPERVISED.with(|depth| depth.set(depth.get() - 1));
        match polled {
            Ok(poll) => poll,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".to_string());
                let failure = Failure {
                    task: this.task,
                    location: LOCATION.with(Cell::take),
                    message,
                };
                failures().send_if_modified(|first| {
                    let empty = first.is_none();
                    if empty {
                        *first = Some(failure);
                    }
                    empty
                });
                std::panic::resume_unwind(payload)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_reported_with_its_task_and_still_reaches_the_handle() {
        install_panic_hook();
        let quiet = spawn("quiet", async { 7 });
        assert_eq!(quiet.await.unwrap(), 7);
        let handle = spawn("follower", async {
            tokio::task::yield_now().await;
            panic!("lost the pointer");
        });
        let failure = failed().await;
        assert_eq!(failure.task, "follower");
        assert_eq!(failure.message, "lost the pointer");
        assert!(
            failure
                .location
                .as_deref()
                .is_some_and(|l| l.contains("tasks.rs")),
            "{failure:?}"
        );
        let line = failure.to_string();
        assert!(
            line.starts_with("background task follower panicked at "),
            "{line}"
        );
        assert!(!line.contains('\n'), "{line}");
        assert!(handle.await.unwrap_err().is_panic());
    }
}
