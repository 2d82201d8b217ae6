"""The suite's two tiers, by measured time: the fast tier (the README's test command) and the slow tier.

The README's command, ``python -m pytest -q -n 2 tests``, runs the fast tier, which must stay under 8 minutes on a
2-core machine; ``--tier slow`` runs the rest and ``--tier all`` both; naming a test (``file::test``) runs it
whatever its tier. CI (``.ci/run``) runs both tiers on every torch version it tests, so nothing goes untested: the
slow tier is the tests that take longest one by one, most of them several processes (gloo ranks, restarted jobs,
a tool's whole command) or whole steps lowered through Inductor and compared with eager.

``SECONDS``: each test's time (setup, call and teardown) in a run of the whole suite on a 2-core machine, two
pytest-xdist workers, torch 2.13 (``python -m pytest -q -n 2 tests --tier all --durations=0 -p no:randomly``,
2026-12-01), for the tests over 4 s. A test at ``SLOW_SECONDS`` or over is in the slow tier, and so is every test
that uses one of ``SLOW_FIXTURES`` (a module fixture that runs a whole tool or a series of jobs once for the tests
of its module, which check its output quickly). Within a tier the longest tests start first: pytest-xdist hands
each worker a first block of tests and the rest as workers free up, so a long test left for the end keeps one
worker busy while the other has nothing left.
"""

# at 8 s the fast tier's pytest took 366 s on torch 2.13 and 453 s on torch 2.15 in CI (2026-12-01): 6 s leaves room
SLOW_SECONDS = 6.0

SLOW_FIXTURES = {"tests/test_bench.py": "run", "tests/test_compile_cache.py": "restarts"}

SECONDS = {
    "tests/test_piecewise.py::test_fully_shard_compiled_in_pieces_cut_inside_flights_matches_fsdp2": 72.5,
    "tests/test_bench_compile.py::test_cold_then_warm_runs_on_two_gloo_ranks_compile_once_then_not_at_all": 47.2,
    "tests/test_compile_cache.py::test_what_the_code_says_now_runs_after_each_edit_between_restarts": 40.1,
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[tensor_parallel0]": 33.5,
    "tests/test_tensor_parallel.py::test_foreach_optimizers_with_tensor_parallel_match_fsdp2": 32.1,
    "tests/test_bench.py::test_every_mode_reported_in_order_on_two_gloo_ranks": 29.5,
    "tests/test_float64_parity.py::test_pass_pipeline_matches_eager_ddp_in_float64[passes-inductor-fused]": 27.6,
    "tests/test_bench_tp.py::test_bench_tp_runs_the_cpu_modes_on_4_gloo_ranks": 27.3,
    "tests/test_recompute.py::test_a_dropout_mask_the_backward_reads_is_kept_in_bool_not_as_its_float32_draw": 27.2,
    "tests/test_float64_parity.py::test_pass_pipeline_matches_eager_ddp_in_float64[passes-inductor-foreach]": 26.4,
    "tests/test_optimizers.py::test_every_optimizer_matches_eager_ddp_in_float64": 26.4,
    "tests/test_hf_models.py::test_hf_llama_lowered_by_inductor_reads_its_shifted_labels_from_memory_and_trains_like_eager": 25.3,
    "tests/test_hf_models.py::test_hf_llama_is_cut_into_pieces_compiled_side_by_side_and_trains_like_eager": 45.0,
    "tests/test_recompute.py::test_the_default_recompute_adds_no_kernel_under_inductor": 24.8,
    "tests/test_conv_layouts.py::test_a_step_cut_into_pieces_reads_each_gradient_in_the_layout_its_piece_returns": 35.4,
    "tests/test_shard_safety.py::test_activation_checkpointing_reentrant_or_not_matches_fsdp2": 23.5,
    "tests/test_zoo.py::test_an_llms_full_size_step_is_cut_beside_its_loss_not_through_its_float32_softmax[qwen2-cpu]": 13.5,
    "tests/test_input_casts.py::test_the_casts_a_convolution_backward_reads_are_made_again_there_in_one_kernel_and_the_step_is_unchanged": 12.0,
    "tests/test_zoo.py::test_an_llms_full_size_step_is_cut_beside_its_loss_not_through_its_float32_softmax[llama-cpu]": 11.5,
    "tests/test_input_casts.py::test_casts_beyond_a_group_are_each_made_again_by_a_cast_of_their_own": 8.0,
    "tests/test_input_casts.py::test_each_backward_of_a_step_makes_its_own_casts_and_the_step_is_unchanged": 25.0,
    "tests/test_step_counts.py::test_the_batch_norms_batch_counts_are_added_in_one_call_and_the_step_is_unchanged": 27.8,
    "tests/test_recompute.py::test_a_group_norm_split_and_made_again_in_the_backward_trains_as_eager_in_float64": 23.2,
    "tests/test_comm_passes.py::test_mlp_bucketed_and_scheduled_matches_ddp[foreach]": 19.4,
    "tests/test_tensor_parallel.py::test_sharded_modes_with_tensor_parallel_match_fsdp2": 19.0,
    "tests/test_demo.py::test_demo_trains_on_two_cpu_processes_names_each_mode_and_matches_ddp": 18.7,
    "tests/test_dist_pool.py::test_tests_reuse_the_ranks_of_their_world_size": 18.4,
    "tests/test_hf_models.py::test_hf_t5_trains_like_eager_in_float64": 17.9,
    "tests/test_tp_checkpoint.py::test_dcp_checkpoints_cross_load_between_spmd_and_fsdp2_with_tensor_parallel": 17.6,
    "tests/test_piecewise.py::test_pieces_compiled_here_and_in_a_worker_run_as_the_graph_and_load_again": 17.3,
    "tests/test_graph_memory.py::test_memory_estimate_measures_each_row_beside_fsdp2_with_checkpointed_blocks": 17.1,
    "tests/test_piecewise.py::test_a_worker_compiles_a_piece_that_launches_a_collective_and_one_that_waits_on_it": 16.6,
    "tests/test_hf_models.py::test_hf_t5_in_bf16_autocast_is_a_graph_inductor_can_take": 15.2,
    "tests/test_inductor_lowering.py::test_inductor_lowered_step_matches_ddp[replicate-foreach]": 15.1,
    "tests/test_shard_parity.py::test_fully_shard_and_shard_grad_op_match_fsdp2": 15.0,
    "tests/test_recompute.py::test_max_pooling_keeps_its_int8_offsets_and_makes_its_indices_again_in_its_backward": 14.7,
    "tests/test_zoo.py::test_spmd_step_matches_eager[t5]": 14.3,
    "tests/test_tensor_parallel.py::test_hybrid_shard_over_a_3d_mesh_matches_fsdp2_hsdp_with_tensor_parallel": 14.3,
    "tests/test_eager_sharded.py::test_a_sharded_model_runs_eagerly_and_returns_what_fsdp2_returns": 14.3,
    "tests/test_inductor_lowering.py::test_inductor_keeps_the_collective_and_wait_order_the_passes_chose": 14.1,
    "tests/test_cache_key.py::test_the_key_is_equal_in_fresh_processes_and_after_other_steps_ran": 13.6,
    "tests/test_timeline.py::test_record_itermove_on_cpu_profiles_setup_main_cleanup": 13.4,
    "tests/test_inductor_lowering.py::test_inductor_lowered_step_matches_ddp[pipeline-foreach]": 13.0,
    "tests/test_inductor_lowering.py::test_inductor_compiles_every_graph_of_a_moved_step_before_it_runs": 13.0,
    "tests/test_recompute.py::test_attention_dropout_is_recomputed_beside_its_backward_and_the_step_computes_the_same": 12.9,
    "tests/test_shard_checkpoint.py::test_dcp_roundtrip_meta_init_cross_loads_with_fsdp2_and_full_state_dict": 12.6,
    "tests/test_tensor_parallel.py::test_rank_agreement_compares_collectives_per_mesh_dimension": 12.5,
    "tests/test_trace_reuse.py::test_a_kept_trace_is_reused_until_what_it_ran_or_read_changes": 12.2,
    "tests/test_loss_lowering.py::test_the_loss_gradient_waits_for_the_loss_and_the_head_weight_gradient_stays_after_it": 11.9,
    "tests/test_graph_memory.py::test_memory_estimate_reports_each_modes_peak_and_sharding_lowers_it": 11.9,
    "tests/test_reduced_inputs.py::test_each_residual_a_norm_reads_is_written_once_and_the_step_computes_the_same": 11.7,
    "tests/test_fresh_process.py::test_a_forked_command_sees_its_argv_folder_and_environment_and_exits_with_its_status": 11.6,
    "tests/test_compile_once.py::test_ranks_with_their_own_cache_directories_get_the_step_through_the_job": 11.3,
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[README0]": 11.2,
    "tests/test_bench.py::test_repeat_1_frees_each_mode_before_building_the_next": 10.7,
    "tests/test_grouped_mm.py::test_fused_adamw_gets_each_expert_gradient_laid_out_as_its_parameter[opaque_fused_op]": 10.4,
    "tests/test_inductor_lowering.py::test_a_dropout_mask_drawn_on_the_cpu_is_drawn_before_its_readers_and_as_eager_draws_it": 9.7,
    "tests/test_accumulation.py::test_sharded_accumulation_matches_fsdp2": 9.6,
    "tests/test_reduced_inputs.py::test_a_feature_map_is_left_to_inductors_layout_choice": 9.5,
    "tests/test_reduced_inputs.py::test_a_layer_norm_input_is_written_once_and_trains_as_eager": 9.4,
    "tests/test_compile_once.py::test_a_failed_compile_reaches_the_waiting_rank_and_a_later_call_compiles_again": 9.3,
    "tests/test_compile_cache.py::test_ranks_whose_steps_read_their_rank_never_share_a_trace": 9.3,
    "tests/test_cli.py::test_installed_spmd_script_prints_help": 9.2,
    "tests/test_frozen_layers.py::test_sharded_freeze_and_unfreeze_match_fsdp2[fully_shard]": 9.0,
    "tests/test_one_rank.py::test_one_rank_step_through_inductor_matches_eager_in_float64": 9.0,
    "tests/test_inductor_lowering.py::test_inductor_lowered_sum_matches_ddp_with_plain_sgd": 8.7,
    "tests/test_loss_lowering.py::test_shifted_labels_reach_the_loss_gradient_from_memory[cpu]": 8.5,
    "tests/test_compile_once.py::test_one_rank_compiles_with_inductor_and_the_other_loads_its_code_and_trains_identically": 8.1,
    "tests/test_low_precision.py::test_low_precision_parameters_update_as_eager_ddp": 8.0,
    "tests/test_frozen_layers.py::test_sharded_freeze_and_unfreeze_match_fsdp2[shard_grad_op]": 7.9,
    "tests/test_shard_parity.py::test_hybrid_shard_matches_fsdp2_hsdp_on_4_ranks": 7.7,
    "tests/test_inductor_cache.py::test_a_restarted_process_loads_the_step_from_inductors_fx_graph_cache_and_trains_the_same[cpu]": 7.5,
    "tests/test_inductor_code.py::test_a_restarted_process_runs_the_kept_code_without_inductor_and_trains_identically[cpu]": 7.3,
    "tests/test_shard_graph.py::test_the_optimizers_list_ops_traced_on_local_shards_make_the_graph_dtensor_makes[fused]": 7.2,
    "tests/test_frozen_layers.py::test_replicate_freeze_and_unfreeze_match_ddp": 7.1,
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[step_contents3]": 7.0,
    "tests/test_comm_passes.py::test_buckets_are_greedy_in_gradient_order_by_bytes[gpt-0.001]": 6.7,
    "tests/test_tensor_parallel.py::test_replicate_with_tensor_parallel_matches_single_process": 6.5,
    "tests/test_failed_step.py::test_a_step_failing_in_the_backward_changes_nothing": 6.3,
    "tests/test_hf_models.py::test_hf_llama_keeps_every_graph_input_in_place_and_trains_like_eager": 6.2,
    "tests/test_hf_models.py::test_hf_llama_gqa_in_bf16_trains_bit_for_bit_as_eager": 6.2,
    "tests/test_inductor_lowering.py::test_inductor_lowered_step_matches_ddp[pipeline-fused]": 6.1,
    "tests/test_autocast_dtypes.py::test_matmul_dtypes_under_autocast_are_torch_compiles[False]": 6.0,
    "tests/test_recompute.py::test_free_recompute_keeps_what_costs_a_write_and_off_keeps_everything": 5.7,
    "tests/test_shard_graph.py::test_the_optimizers_list_ops_traced_on_local_shards_make_the_graph_dtensor_makes[foreach]": 5.6,
    "tests/test_grouped_mm.py::test_fused_adamw_gets_each_expert_gradient_laid_out_as_its_parameter[aten_fused_op]": 5.5,
    "tests/test_zoo.py::test_spmd_step_matches_eager[llama_lora]": 5.5,
    "tests/test_tp_graph.py::test_tp_collectives_labelled_by_mesh_dim_on_their_groups_and_scheduled_on_the_critical_path[fully_shard]": 5.4,
    "tests/test_trace_reuse.py::test_a_step_that_reads_what_no_guard_checks_is_traced_every_time": 5.3,
    "tests/test_trace_through.py::test_compiled_blocks_train_as_fsdp2_under_fully_shard": 5.3,
    "tests/test_compile_cache.py::test_a_damaged_entry_is_reported_once_removed_and_compiled_again": 5.3,
    "tests/test_uneven_batches.py::test_fully_shard_uneven_last_batch_matches_fsdp2": 5.3,
    "tests/test_failed_step.py::test_no_state_is_written_before_the_last_collective_completes[fully_shard]": 5.3,
    "tests/test_comm_passes.py::test_passes_keep_the_single_process_step_exact": 5.1,
    "tests/test_optimizers.py::test_one_cycle_lr_cycles_lr_and_momentum_with_one_trace": 5.1,
    "tests/test_zoo.py::test_fully_shard_in_a_group_of_one_matches_eager[llama]": 5.1,
    "tests/test_grad_scaler.py::test_sharded_step_with_grad_scaler_matches_fsdp2[fully_shard-single_tensor]": 5.0,
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[modes0]": 4.9,
    "tests/test_trace_through.py::test_a_zero_dim_parameter_is_replicated_under_the_sharded_modes_and_trains_as_ddp[fully_shard]": 4.8,
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[modes1]": 4.8,
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[memory0]": 4.7,
    "tests/test_recompute.py::test_a_budget_keeps_what_the_loss_backward_reads_first_and_repeats_norms_before_matmuls": 4.7,
    "tests/test_zoo.py::test_fully_shard_in_a_group_of_one_matches_eager[mixtral]": 4.5,
    "tests/test_compile_once.py::test_a_rank_that_waits_for_a_silent_compiling_rank_gives_up_with_an_error": 4.5,
    "tests/test_zoo.py::test_the_step_with_eagers_backward_dtypes_matches_eager": 4.5,
    "tests/test_comm_passes.py::test_gpt_avg_bucketed_and_scheduled_matches_ddp": 4.4,
    "tests/test_inductor_code.py::test_kept_code_that_does_not_load_is_compiled_again_and_replaced": 4.2,
    "tests/test_accumulation.py::test_replicate_accumulation_matches_ddp_no_sync[2-False]": 4.1,
    "tests/test_hf_models.py::test_hf_mixtral_with_batched_experts_trains_like_eager": 4.1,
    "tests/test_retrace.py::test_deferred_updates_survive_a_batch_shape_change[evict]": 4.1,
}


def fixture_group(nodeid: str, fixturenames) -> str:
    """The test's file where it uses that file's slow module fixture (its tests are timed as one), else itself."""
    file = nodeid.split("::")[0]
    return file if SLOW_FIXTURES.get(file) in fixturenames else nodeid


def is_slow(nodeid: str, fixturenames) -> bool:
    """Whether the test ``nodeid`` (using ``fixturenames``) is in the slow tier."""
    return SECONDS.get(nodeid, 0.0) >= SLOW_SECONDS or fixture_group(nodeid, fixturenames) != nodeid
