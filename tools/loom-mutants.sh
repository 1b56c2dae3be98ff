#!/usr/bin/env bash
# Builds each deliberate mutation of cuarena (--cfg cuarena_mutant="NAME") and runs the loom
# model that should catch it. Prints one line per mutation: CAUGHT (the model failed, as it
# must) or MISSED. Exits non-zero if any mutation is missed.
set -uo pipefail
cd "$(dirname "$0")/.."
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
missed=0
while read -r mutant test filter; do
  [ -z "$mutant" ] && continue
  log="target/loom-mutants/$mutant.log"
  mkdir -p target/loom-mutants
  RUSTFLAGS="--cfg loom --cfg cuarena_mutant=\"$mutant\"" CARGO_TARGET_DIR=target/loom-mutant \
    cargo test -p loom-tests --release --test "$test" -- "$filter" >"$log" 2>&1
  # A failing loom model panics (and often aborts while dropping loom objects afterwards).
  if grep -q "could not compile" "$log"; then
    echo "BUILD-FAILED  $mutant ($test::$filter): see $log"
    missed=1
  elif grep -q "panicked at" "$log" && ! grep -q "test result: ok" "$log"; then
    why=$(grep -m1 -E "panicked at" -A1 "$log" | tr '\n' ' ' | cut -c1-240)
    echo "CAUGHT  $mutant ($test::$filter): $why"
  else
    echo "MISSED  $mutant ($test::$filter)"
    missed=1
  fi
done <<'LIST'
inbox_push_relaxed       inbox      concurrent_pushes_and_drains_deliver_each_value_once
inbox_take_relaxed       inbox      concurrent_pushes_and_drains_deliver_each_value_once
registry_publish_relaxed registry   a_lock_free_lookup_sees_an_initialised_superblock_or_nothing
registry_replace_relaxed registry   a_lookup_racing_a_large_superblock_over_normal_ones_sees_the_old_or_the_new
registry_replace_relaxed registry   a_lookup_racing_normal_superblocks_over_a_large_one_sees_the_old_or_the_new
fence_skip_check         allocator  a_remotely_freed_block_is_not_reused_while_its_fence_is_pending
exit_close_first         allocator  a_remote_free_racing_the_owners_exit_is_adopted
exit_close_first         large      a_large_block_freed_remotely_while_its_owner_exits_is_adopted
exit_close_first         large      a_large_superblock_given_back_with_a_remote_free_in_flight_loses_nothing
owner_cleared_early      allocator  a_superblock_given_back_with_a_remote_free_in_flight_loses_nothing
owner_cleared_early      large      a_large_superblock_given_back_with_a_remote_free_in_flight_loses_nothing
stats_retire_unlocked    allocator  stats_read_while_a_thread_retires_are_consistent
claim_no_light_barrier   claim      an_owner_and_a_reclaimer_are_never_inside_at_once
claim_no_light_barrier   allocator  a_reclaim_racing_the_owner_loses_nothing
transit_unmarked         allocator  a_second_free_while_the_first_waits_in_an_outbox_is_refused
owner_free_unmarked      allocator  a_remote_free_after_the_owners_local_free_is_refused
carve_ignores_transit    allocator  a_bad_free_on_its_way_is_never_taken_as_a_free_of_a_later_block
graph_flag_unset         graph_pool a_graph_block_freed_by_another_thread_is_taken_back_by_its_pool
pool_free_unmarked       allocator  a_second_free_after_the_range_is_lent_again_is_refused
zombie_no_sync           user_streams a_destroyed_streams_arena_is_reused_only_after_a_synchronise
zombie_never_parked      user_streams a_destroyed_streams_arena_is_reused_only_after_a_synchronise
zombie_no_sync           user_streams a_parked_user_stream_free_is_reused_only_after_a_synchronise
parked_frees_unfenced    user_streams a_parked_user_stream_free_is_reused_only_after_a_synchronise
adopt_any_parked         user_streams a_parked_arena_is_adopted_only_by_its_own_stream
stats_peak_no_barrier    stats      a_peak_reset_racing_a_threads_allocations_keeps_the_upper_bound
stats_reset_stores_counters stats   a_counter_reset_racing_a_threads_bumps_is_not_lost
stats_exact_free_local_first stats an_exact_peak_reset_racing_a_free_stays_within_the_upper_bound
trace_no_owner_fence     trace      a_stop_racing_an_owner_loses_and_duplicates_no_record
trace_no_wait            trace      a_stop_racing_an_owner_loses_and_duplicates_no_record
trace_no_wait            trace      a_stop_racing_an_owners_exit_loses_no_record
trace_exit_unregisters_early trace  a_stop_racing_an_owners_exit_loses_no_record
trace_alloc_flag_first   trace      an_allocation_that_takes_a_recorded_free_is_recorded
legacy_covered_early     legacy     a_reused_legacy_free_follows_an_action_issued_after_its_use
pool_legacy_no_action    legacy     a_reused_legacy_pool_free_follows_an_action_issued_after_its_use
legacy_covered_unchecked legacy     a_reused_legacy_free_follows_an_action_issued_after_its_use
legacy_read_after_call   legacy_roles an_action_queued_before_a_use_never_covers_its_ticket
waiters_load_parked_first replay_waiters a_wait_racing_the_store_sees_the_value
synchronise_after_unlock captures   a_synchronise_never_runs_inside_an_announced_capture
legacy_check_unlocked    captures   a_legacy_record_never_runs_inside_an_announced_capture
hold_ignores_capture_end held       a_free_held_around_a_captures_end_is_made_by_one_of_them
capture_end_skips_on_count held     a_free_held_around_a_captures_end_is_made_by_one_of_them
retry_unlists_held       held       a_second_free_racing_the_retry_of_a_held_free_is_refused
retry_ignores_capture_end held      a_retry_racing_the_captures_end_leaves_nothing_held
LIST
exit $missed
