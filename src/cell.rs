//! The one rule for state that Envoy's contexts of a VM share through `Rc<RefCell<_>>` (the
//! worker's pipeline, its telemetry): it is changed only through [`with_mut`], which never
//! panics. A cell found busy (only a re-entry could make it so, and no callback re-enters) is
//! logged and the change skipped. `RefCell::borrow_mut` and `try_borrow_mut` are refused
//! everywhere else by clippy (`disallowed-methods` in clippy.toml; tests may use them).

use std::cell::RefCell;

/// Runs `change` on the value in `cell`; `None` (logged) if the cell is borrowed already.
pub fn with_mut<T, R>(cell: &RefCell<T>, change: impl FnOnce(&mut T) -> R) -> Option<R> {
    #[allow(clippy::disallowed_methods)]
    let borrowed = cell.try_borrow_mut();
    match borrowed {
        Ok(mut value) => Some(change(&mut value)),
        Err(_) => {
            busy();
            None
        }
    }
}

#[inline(never)]
fn busy() {
    log::error!("shared state busy (a callback re-entered): one change was skipped");
}
