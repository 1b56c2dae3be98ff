//! Adversarial checks of the process-wide allocators' defaults under `CUARENA_CONF`
//! (`global::set_defaults`, C `cuarena_set_defaults`), from a helper's attack (session 13).
//!
//! Defaults valid alone and a `CUARENA_CONF` valid alone can be invalid together (a chunk must be
//! a whole number of superblocks, `small_max` at most a superblock, `max` at least one). The
//! library then refuses to make the device's allocator; its error must name the defaults, or a
//! user reading their `CUARENA_CONF` cannot find the cause (before the fix it blamed
//! `CUARENA_CONF` alone). And a refusal by `set_defaults` must say so, not blame `CUARENA_CONF`.
//!
//! Each case runs in a child process of this test binary, because `CUARENA_CONF` is read from
//! the environment and the defaults are process-wide. No GPU is needed: the configuration is
//! parsed before the driver is looked for, and a failed creation is not cached.

use std::process::Command;

const CHILD: &str = "CUARENA_S13_CHILD";

/// In a child: sets the defaults from `CUARENA_S13_DEFAULTS` and prints what `global(0)` says.
#[test]
fn child() {
    let Ok(defaults) = std::env::var(CHILD) else { return };
    cuarena::global::set_defaults(&defaults).expect("the defaults are valid alone");
    match cuarena::global::global(0) {
        Ok(_) => println!("S13: ok"),
        Err(e) => println!("S13: {e}"),
    }
}

/// What `global(0)` says in a fresh process with `defaults` set and `CUARENA_CONF=user`.
fn global_says(defaults: &str, user: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD, defaults)
        .env("CUARENA_CONF", user)
        .output()
        .expect("running the child");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    text.lines()
        .find_map(|l| l.split_once("S13: ").map(|(_, m)| m))
        .unwrap_or_else(|| panic!("no answer: {text}"))
        .to_string()
}

#[test]
fn an_error_that_only_the_defaults_cause_names_the_defaults() {
    // Each user string is valid alone, each default valid alone.
    for (defaults, user) in [
        ("chunk=6MiB", "superblock=4MiB"),
        ("superblock=4MiB", "chunk=6MiB"),
        ("small_max=2MiB", "superblock=1MiB"),
        ("max=2MiB", "superblock=4MiB"),
    ] {
        assert!(cuarena::Config::parse(user).is_ok(), "{user} is valid alone");
        assert!(cuarena::Config::parse(defaults).is_ok(), "{defaults} is valid alone");
        let m = global_says(defaults, user);
        assert!(
            m.contains("invalid cuarena configuration"),
            "defaults {defaults:?}, CUARENA_CONF={user:?}: {m}"
        );
        assert!(
            m.contains("default"),
            "defaults {defaults:?}, CUARENA_CONF={user:?}: the error blames CUARENA_CONF (valid alone) and \
             never mentions the defaults that hold the other value: {m}"
        );
    }
}

#[test]
fn a_refused_default_is_not_blamed_on_cuarena_conf() {
    let e = cuarena::global::set_defaults("bogus=1").unwrap_err().to_string();
    assert!(
        e.contains("default") || e.contains("set_defaults"),
        "set_defaults' refusal says the item was set in CUARENA_CONF or Config::builder(): {e}"
    );
}
