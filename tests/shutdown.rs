//! Once process exit has begun, the C ABI refuses allocations with [`Error::ShutDown`]'s
//! message. The check runs in a child process, from an `atexit` handler that runs after
//! cuarena's own (`atexit` handlers run in the reverse order of their registration).

use std::ffi::{CStr, c_int};

use cuarena::Error;
use cuarena_c::{cuarena_last_error, cuarena_malloc};

/// The C ABI (`capi/`, built as libcuarena.so), compiled into this test to be called as Rust.
#[allow(dead_code)] // this test calls two of its functions
#[path = "../capi/src/lib.rs"]
mod cuarena_c;

unsafe extern "C" {
    fn atexit(cb: extern "C" fn()) -> c_int;
    fn _exit(code: c_int) -> !;
}

/// Exit status of a child whose refused allocation carried the expected message.
const PASSED: c_int = 0;
/// Exit status of a child that saw anything else.
const FAILED: c_int = 3;

/// Runs during exit, after cuarena's hook has marked the process as exiting.
extern "C" fn allocate_during_exit() {
    let p = cuarena_malloc(4096, 0, std::ptr::null_mut());
    let e = cuarena_last_error();
    let msg = if e.is_null() {
        "<no error set>".to_string()
    } else {
        // SAFETY: a non-null result is a NUL-terminated string valid until the next failing call.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    };
    let passed = p.is_null() && msg == Error::ShutDown.to_string();
    eprintln!("child: malloc during exit gave {p:?}, last error: {msg}");
    // SAFETY: `_exit` ends the process at once; nothing of this process is used after it.
    unsafe { _exit(if passed { PASSED } else { FAILED }) }
}

#[test]
fn an_allocation_during_process_exit_fails_with_the_shut_down_error() {
    if std::env::var_os("CUARENA_SHUTDOWN_CHILD").is_some() {
        // Registered first, so it runs after cuarena's hook, registered just below.
        // SAFETY: `allocate_during_exit` is a plain function that lives for the whole process.
        assert_eq!(unsafe { atexit(allocate_during_exit) }, 0);
        cuarena::shutdown::install_exit_hook();
        assert!(!cuarena::shutdown::process_exiting());
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "an_allocation_during_process_exit_fails_with_the_shut_down_error", "--nocapture"])
        .env("CUARENA_SHUTDOWN_CHILD", "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(PASSED), "child:\n{text}");
    assert!(text.contains(&format!("last error: {}", Error::ShutDown)), "{text}");
    assert!(text.contains("process exit has begun"), "{text}");
}
