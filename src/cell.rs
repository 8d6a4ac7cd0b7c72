//! The one rule for state that Envoy's contexts of a VM share through `Rc<RefCell<_>>` (the
//! worker's pipeline, its telemetry): it is changed only through [`with_mut`], which never
//! panics. A cell found busy (only a re-entry could make it so, and no callback re-enters)
//! skips the change. `RefCell::borrow_mut` and `try_borrow_mut` are refused everywhere else
//! by clippy (`disallowed-methods` in clippy.toml; tests and harnesses may use them).

use std::cell::RefCell;

/// Runs `change` on the value in `cell`; `None` if the cell is borrowed already.
/// (Inlined: one function per call site would cost the module kilobytes.)
#[inline(always)]
pub fn with_mut<T, R>(cell: &RefCell<T>, change: impl FnOnce(&mut T) -> R) -> Option<R> {
    #[allow(clippy::disallowed_methods)]
    let borrowed = cell.try_borrow_mut();
    // A match, not `Result::ok().map`: that moves `change` (and what it captured, a whole
    // job for the pipeline's `begin`) into another closure first.
    match borrowed {
        Ok(mut value) => Some(change(&mut value)),
        Err(_) => None,
    }
}
