# ruff: noqa: E501
"""Plants each bug a test guards against in a scratch copy of the repo and runs the tests that must catch it.

python scripts/plant_bugs.py [NAME_SUBSTRING ...]      # results: results/planted_bugs.json
                                                        # (or $LRAGENT_PLANTED_RESULTS)

An entry is (file, old, new, tests); old and new may be tuples of strings replaced pairwise (a bug planted in several
places). Entries whose tests are GPU-marked catch their bug only on a GPU (without one they skip: exit 0).
"""

import json
import os
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRATCH = os.environ.get("LRAGENT_PLANT_SCRATCH", "/tmp/lragent_plant_copy")
RESULTS = os.environ.get("LRAGENT_PLANTED_RESULTS") or os.path.join(ROOT, "results", "planted_bugs.json")
BUGS = {
    "several-GPU report: the first pair's speed-up kept when repeats ran": (
        "eval_suite/multi_gpu_report.py",
        '            res[f"ddp{n}_speedup_tokens_per_s"] = (sum(ddps) / len(ddps)) / (sum(ones) / len(ones))',
        '            res[f"ddp{n}_speedup_tokens_per_s"] = ddps[0] / ones[0]',
        "tests/test_multi_gpu_report.py",
    ),
    "several-GPU report: the repeat pairs' val losses not read": (
        "eval_suite/multi_gpu_report.py",
        '    ones_losses = {k: val_losses(out / f"{one}r{k}_metrics.csv") for k in REPEATS}',
        "    ones_losses = {k: None for k in REPEATS}",
        "tests/test_multi_gpu_report.py -k each_repeat_pair",
    ),
    "several-GPU report: the repeats' noise verdict passes when any pair is within": (
        "eval_suite/multi_gpu_report.py",
        'res[f"ddp{n}_repeats_within_noise"] = all(abs(d[-1])',
        'res[f"ddp{n}_repeats_within_noise"] = any(abs(d[-1])',
        "tests/test_multi_gpu_report.py -k each_repeat_pair",
    ),
    "several-GPU report: every phase counted once a micro-batch (the optimizer step too, where it ran every 4th)": (
        "eval_suite/multi_gpu_report.py",
        "        host_ms = sum(ms * count.get(k, 0) for k, ms in host.items()) / steps",
        "        host_ms = sum(host.values())",
        "tests/test_multi_gpu_report.py -k host_split",
    ),
    "provenance: the switches that were set not recorded": (
        "lragent/provenance.py",
        '        "switches": switches(),',
        '        "switches": {},',
        "tests/test_provenance.py",
    ),
    "bench decode: pdl=0 in --plans taken for an attention knob (PDL not switched)": (
        "eval_suite/bench_decode.py",
        '    "pdl": ("LRAGENT_PDL", "kernels.pdl:pdl_switch", "pdl"),\n',
        "",
        "tests/test_decode_floor.py",
    ),
    "several-GPU report: repeats not read": (
        "eval_suite/multi_gpu_report.py",
        '    for run in [name, *(f"{name}r{k}" for k in REPEATS)]:',
        "    for run in [name]:",
        "tests/test_multi_gpu_report.py",
    ),
    "DDP: Lightning's per-batch SIGTERM broadcast left in place (a GPU collective and drain every batch)": (
        "lit_modules/multi_lora_module.py",
        "        return [HostSigtermAgreement()]",
        "        return []",
        "tests/test_multi_gpu.py::test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_batch_without_a_gpu_collective",
    ),
    "DDP: each rank acts on its own SIGTERM flag (no agreement)": (
        "lit_modules/sigterm_check.py",
        "        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.group)",
        "        pass",
        "tests/test_multi_gpu.py::test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_batch_without_a_gpu_collective",
    ),
    "DDP: the SIGTERM agreement at every batch whatever LRAGENT_SIGTERM_EVERY says": (
        "lit_modules/sigterm_check.py",
        "        if self.batches < self.next_at:",
        "        if False:",
        "tests/test_multi_gpu.py::test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_batch_without_a_gpu_collective",
    ),
    "DDP: the SIGTERM agreement one batch late after each (at 1, 5, 9 ... for an interval of 3)": (
        "lit_modules/sigterm_check.py",
        "self.last_at, self.last_time, self.next_at = self.batches, now, self.batches + interval",
        "self.last_at, self.last_time, self.next_at = self.batches, now, self.batches + interval + 1",
        "tests/test_multi_gpu.py::test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_batch_without_a_gpu_collective",
    ),
    "DDP: the interval from the pace without its cap (a stop could wait dozens of batches)": (
        "lit_modules/sigterm_check.py",
        "    return max(1, min(MAX_EVERY, int(TARGET_S * batches / seconds)))",
        "    return max(1, int(TARGET_S * batches / seconds))",
        "tests/test_multi_gpu.py -k interval_from_the_pace",
    ),
    "DDP: LRAGENT_SIGTERM_EVERY=0 taken (silently the pace's interval)": (
        "lit_modules/sigterm_check.py",
        "    if not raw.isdigit() or int(raw) < 1:",
        "    if not raw.isdigit():",
        "tests/test_multi_gpu.py -k agreement_interval",
    ),
    "rank pinning: hyperthread siblings split between ranks (CPUs shared out one by one)": (
        "lragent/host_threads.py",
        "        cores.setdefault(core_of[cpu], []).append(cpu)",
        "        cores.setdefault((0, cpu), []).append(cpu)",
        "tests/test_rank_pinning.py",
    ),
    "rank pinning: every local rank of a fit pinned as rank 0 (all on the first share)": (
        "lit_modules/multi_lora_module.py",
        "                pinned = pin_rank(self.trainer.local_rank, self.trainer.num_devices, os.environ)",
        "                pinned = pin_rank(0, self.trainer.num_devices, os.environ)",
        "tests/test_rank_pinning.py",
    ),
    "rank pinning: pinned without LRAGENT_PIN_CORES=1": (
        "lragent/host_threads.py",
        '    if not pin_requested(env) or ranks < 2 or not hasattr(os, "sched_setaffinity"):',
        '    if ranks < 2 or not hasattr(os, "sched_setaffinity"):',
        "tests/test_rank_pinning.py",
    ),
    "decode floor: the copy rate a median of the copies (not the fastest)": (
        "eval_suite/bench_decode.py",
        "    return 2 * n_bytes / min(seconds)",
        "    return 2 * n_bytes / sorted(seconds)[len(seconds) // 2]",
        "tests/test_decode_floor.py",
    ),
    "decode floor: the run's first bandwidth measure taken (not the highest)": (
        "eval_suite/bench_decode.py",
        "    bandwidth = max(bandwidths)",
        "    bandwidth = bandwidths[0]",
        "tests/test_decode_floor.py",
    ),
    "speed table: an experiment's plan counted as the product's figure": (
        "eval_suite/speed_table.py",
        '                        and r.get("batch") == batch and not r.get("plan")]  # fmt: skip',
        '                        and r.get("batch") == batch]  # fmt: skip',
        "tests/test_speed_table.py",
    ),
    "speed table: a folder's decode runs not pooled (the last run's figures only)": (
        "eval_suite/speed_table.py",
        '        pooled.setdefault(key, []).extend(r for r in rec.get("rows", []) if isinstance(r, dict))',
        '        pooled[key] = [r for r in rec.get("rows", []) if isinstance(r, dict)]',
        "tests/test_speed_table.py",
    ),
    "speed table: records of several commits called one": (
        "eval_suite/speed_table.py",
        "    if len(shas) == 1:",
        "    if len(shas) >= 1:",
        "tests/test_speed_table.py",
    ),
    "speed table: the trace's ratio inverted": (
        "eval_suite/speed_table.py",
        "lr['throughput_tok_s'] / base['throughput_tok_s']",
        "base['throughput_tok_s'] / lr['throughput_tok_s']",
        "tests/test_speed_table.py",
    ),
    "GPU-suite record: an interrupted run's nameless entries counted as passed": (
        "scripts/gpu_tests_record.py",
        '        if not case.get("name"):  # an interrupted xdist run leaves nameless entries (<testcase time=".." />): no test',
        "        if False:",
        "tests/test_gpu_tests_record.py -k nameless",
    ),
    "q/k/v in one launch: off again when LRAGENT_QKV_ROPE is unset": (
        "kernels/fused_qkv_rope.py",
        '    raw = (os.environ.get(SWITCH_ENV, "") if value is None else value).strip() or "1"',
        '    raw = (os.environ.get(SWITCH_ENV, "") if value is None else value).strip() or "0"',
        "tests/test_fused_qkv_rope.py -k the_switch_is_on_unless",
    ),
    "several-GPU report: rebuilt off the device, an eval-only call names this machine, not the runs'": (
        "eval_suite/multi_gpu_report.py",
        '    configs = [_json(f) or {} for f in sorted(out.glob("ev*/**/run_config.json"))]',
        "    configs = []",
        "tests/test_multi_gpu_report.py -k rebuilt_off_device",
    ),
    "several-GPU report: the DDP section shown when none of its phases ran": (
        "eval_suite/multi_gpu_report.py",
        "    return any(d.get(k) for k in keys)",
        "    return True",
        "tests/test_multi_gpu_report.py -k shows_only_their_sections",
    ),
    "several-GPU report: the FSDP section hidden unless the one-GPU reference ran": (
        "eval_suite/multi_gpu_report.py",
        '    keys = ["speed_1gpu"] + [k.format(n) for n in sizes for k in per_size]',
        '    keys = ["speed_1gpu"]',
        "tests/test_multi_gpu_report.py -k shows_only_their_sections",
    ),
    "q/k/v in one launch: a program's 16 dims contiguous (RoPE's pairs split over programs)": (
        "kernels/fused_qkv_rope.py",
        "        dims = (i // HB) * HALF + blk * HB + i % HB  # a head program's dims of its head: HB of each half",
        "        dims = blk * 2 * HB + i",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch: the LoRA term rotated the wrong way": (
        "kernels/fused_qkv_rope.py",
        "            tl.store(dst, t1 * c1 - t2 * s1, mask=h_ok[:, None])",
        "            tl.store(dst, t1 * c1 + t2 * s1, mask=h_ok[:, None])",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch: the LoRA term of role 0 whatever the row's role": (
        "kernels/fused_qkv_rope.py",
        "            bp = QB + role * stride_qbr + (out_row * rank)[:, :, None] + rr[None, None, :]",
        "            bp = QB + (out_row * rank)[:, :, None] + rr[None, None, :]",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch: V_lr stored one position early": (
        "kernels/fused_qkv_rope.py",
        "                tl.store(LRP + lslot * stride_lrs + pos * stride_lrl + i, y, mask=i < rank)",
        "                tl.store(LRP + lslot * stride_lrs + (pos - 1) * stride_lrl + i, y, mask=i < rank)",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch, full cache: v stored without its LoRA term": (
        "kernels/fused_qkv_rope.py",
        "                    y = (y.to(tl.float32) + s_v * term).to(dt)",
        "                    y = y",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch, full cache: v's term unscaled": (
        "kernels/fused_qkv_rope.py",
        "                    y = (y.to(tl.float32) + s_v * term).to(dt)",
        "                    y = (y.to(tl.float32) + term).to(dt)",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch, full cache: v's B of role 0 whatever the row's role": (
        "kernels/fused_qkv_rope.py",
        "                    bp = VB + role * stride_vbr + (g * HEAD_D + dims)[:, None] * rank + i[None, :]",
        "                    bp = VB + (g * HEAD_D + dims)[:, None] * rank + i[None, :]",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch, full cache: X·A_v read from the v rows' half of the one pass": (
        "kernels/fused_qkv_rope.py",
        "            xa_v = tl.sum(tl.where(part == 1, yv, 0.0), axis=0).to(dt)",
        "            xa_v = tl.sum(tl.where(part == 0, yv, 0.0), axis=0).to(dt)",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "q/k/v in one launch, full cache: program 0 still stores V_lr (into the pool it was handed)": (
        "kernels/fused_qkv_rope.py",
        "            if not FULL_V:\n                lslot = tl.load(LR_SLOT).to(tl.int64)",
        "            if True:\n                lslot = tl.load(LR_SLOT).to(tl.int64)",
        "tests/test_fused_qkv_rope.py -k one_launch_matches_the_path_it_replaces_under",
    ),
    "GPU suite record: the planted bugs a call never ran not named": (
        "scripts/gpu_tests_record.py",
        '        record["planted_not_reached"] = [n for n in planted_names(args.planted_filter) if n not in done]',
        '        record["planted_not_reached"] = []',
        "tests/test_gpu_tests_record.py",
    ),
    # this file's own code: the anchors are split into two literals, so that the text here does not hold them too
    "plant_bugs: results written only at the end (an interrupted run keeps nothing)": (
        "scripts/plant_bugs.py",
        (
            "            save(results)  # after every entry" + ": a call cut short keeps what finished",
            "        return 130\n    return 0\n",
        ),
        ("            pass", "        return 130\n    save(results)\n    return 0\n"),
        "tests/test_plant_bugs.py",
    ),
    "plant_bugs: an interrupt ends in a traceback": (
        "scripts/plant_bugs.py",
        "    except KeyboardInterrupt:" + "  # a device call's",
        "    except SystemExit:  # a device call's",
        "tests/test_plant_bugs.py",
    ),
    "frozen cast: a tied LM head cast with its embedding": (
        "lragent/frozen_cast.py",
        "        if not isinstance(m, nn.Linear) or id(m.weight) in shared:",
        "        if not isinstance(m, nn.Linear):",
        "tests/test_frozen_cast.py",
    ),
    "frozen cast: a linear's bias left float32 (autocast still casts it at every call)": (
        "lragent/frozen_cast.py",
        "        params = [p for p in (m.weight, m.bias) if p is not None]",
        "        params = [m.weight]",
        "tests/test_frozen_cast.py",
    ),
    "frozen cast: under any precision (32-true too)": (
        "lragent/frozen_cast.py",
        "    dtype = MIXED_DTYPES.get(str(precision))",
        "    dtype = MIXED_DTYPES.get(str(precision), torch.bfloat16)",
        "tests/test_frozen_cast.py",
    ),
    "frozen cast: under FSDP too": (
        "lragent/frozen_cast.py",
        ' or "fsdp" in strategy.lower():',
        ":",
        "tests/test_frozen_cast.py",
    ),
    "frozen cast: LRAGENT_FROZEN_CAST=0 ignored": (
        "lragent/frozen_cast.py",
        "    return dtype if frozen_cast_switch(env) else None",
        "    return dtype",
        "tests/test_frozen_cast.py",
    ),
    "frozen cast: the fit never casts (configure_model skips it)": (
        "lit_modules/multi_lora_module.py",
        "            if cast is not None:\n                n = cast_frozen_linears(self.lora_model.model, cast)",
        "            if cast is None:\n                n = cast_frozen_linears(self.lora_model.model, cast)",
        "tests/test_frozen_cast.py",
    ),
    "q/k/v in one launch, full cache: v's B of another dtype taken as it is": (
        "kernels/fused_qkv_rope.py",
        "        or v_lora[0].dtype != weight.dtype\n",
        "",
        "tests/test_fused_qkv_rope.py -k refused",
    ),
    "q/k/v in one launch: a call with both the V_lr pool and v's B taken": (
        "kernels/fused_qkv_rope.py",
        "    if (lr_pool is None) == (v_lora is None):",
        "    if lr_pool is None and v_lora is None:",
        "tests/test_fused_qkv_rope.py -k refused",
    ),
    "decoder: full caches kept off the one q/k/v launch": (
        "lragent/decoder.py",
        '        if not getattr(view, "qkv_rope", 0) or h.numel() != h.shape[-1]:',
        '        if not getattr(view, "qkv_rope", 0) or not view.decomposed or h.numel() != h.shape[-1]:',
        "tests/test_fused_qkv_rope.py -k engine_decodes_the_same_with_the_launch_under",
    ),
    "decode attention: q_add ignored by the kernel": (
        "kernels/flash_lora_decode.py",
        "                q = (q.to(tl.float32) + tl.load(qa_ptrs, mask=row_ok[:, None], other=0.0)).to(q.dtype)",
        "                q = q",
        "tests/test_fused_qkv_rope.py -k attention_adds_q_add_under",
    ),
    "decoder: the one-launch step's q term never reaches the attention": (
        "lragent/decoder.py",
        '        extra = {} if q_add is None else {"q_add": q_add}',
        "        extra = {}",
        "tests/test_fused_qkv_rope.py -k engine_decodes_the_same_with_the_launch_under",
    ),
    "several benchmarks: the second benchmark counts the process's start again": (
        "eval_suite/run_eval.py",
        "    started, age = time.perf_counter(), process_age_s() if first else 0.0",
        "    started, age = time.perf_counter(), process_age_s()",
        "tests/test_eval_runner.py -k several_benchmarks",
    ),
    "several benchmarks: one queue folder for every benchmark of a launch": (
        "eval_suite/shard_launch.py",
        '        queue = out_dir / BENCHMARK_FIELD / "queue"',
        "        queue = clear_queue(out_dir)",
        "tests/test_eval_runner.py -k several_benchmarks",
    ),
    "several benchmarks: each benchmark's folder is OUT itself": (
        "eval_suite/run_eval.py",
        '        out["out"] = str(_check_out(call["out"]) / name)',
        "        pass",
        "tests/test_eval_runner.py -k several_benchmarks",
    ),
    "several benchmarks: a queue without {benchmark} accepted": (
        "eval_suite/run_eval.py",
        '    if several and call.get("work_queue"):',
        "    if False:",
        "tests/test_eval_runner.py -k bad_benchmark_lists",
    ),
    "several benchmarks: the busiest shard is the slowest of each benchmark added up": (
        "eval_suite/multi_gpu_report.py",
        "    if combined_launch(directory):  # each shard process ran every benchmark: its own sum, the largest of them",
        "    if False:",
        "tests/test_multi_gpu_report.py",
    ),
    "several benchmarks: the queue bound keeps a barrier between benchmarks of one launch": (
        "eval_suite/multi_gpu_report.py",
        "        launches = [([stage for stages, _ in launches for stage in stages], launches[0][1])]",
        "        pass",
        "tests/test_multi_gpu_report.py",
    ),
    "several GPUs: a resumed reference's restart counts its first start too": (
        "eval_suite/multi_gpu_report.py",
        '    return sum((p.get(k) or 0.0 for p in (timing.get("parts") or [])[1:] for k in RESTART_KEYS), 0.0)',
        '    return sum((p.get(k) or 0.0 for p in (timing.get("parts") or []) for k in RESTART_KEYS), 0.0)',
        "tests/test_multi_gpu_report.py",
    ),
    "several GPUs: the queue bound of one launch per benchmark takes one row count for all": (
        "eval_suite/multi_gpu_report.py",
        "    if combined:  # one process runs every benchmark: one row count for all (else no bound)",
        "    if True:  # one process runs every benchmark: one row count for all (else no bound)",
        "tests/test_multi_gpu_report.py",
    ),
    "stage schedule: a process starts the next stage before its own rows have emptied": (
        "eval_suite/multi_gpu_report.py",
        "        while stage[p] < len(queues) and not queues[stage[p]] and not busy[p]:",
        "        while stage[p] < len(queues) and not queues[stage[p]]:",
        "tests/test_multi_gpu_report.py",
    ),
    "eval timing: a stopped run's part not written on the way out": (
        "eval_suite/run_eval.py",
        "                    timing.write(timing_part(ran, time.perf_counter() - loop_started), complete=False)\n",
        "",
        "tests/test_eval_runner.py -k 'sigterm or killed'",
    ),
    "eval timing: SIGTERM left to kill the process": (
        "eval_suite/run_eval.py",
        "    old = signal.signal(signal.SIGTERM, interrupt)",
        "    old = signal.getsignal(signal.SIGTERM)",
        "tests/test_eval_runner.py -k sigterm",
    ),
    "eval timing: a resumed run drops the earlier runs' parts": (
        "eval_suite/eval_timing.py",
        "            self.earlier = list(parts) if isinstance(parts, list) else [earlier]",
        "            self.earlier = []",
        "tests/test_eval_timing.py",
    ),
    "eval timing: the top level is the last part's, not the sum": (
        "eval_suite/eval_timing.py",
        "            out[key] = sum(values) if values else None",
        "            out[key] = values[-1] if values else None",
        "tests/test_eval_timing.py",
    ),
    "several GPUs: a phase resumed in a later call counts only that call": (
        "eval_suite/multi_gpu_report.py",
        'row = {**row, "seconds": before["seconds"] + row["seconds"], "calls": before.get("calls", 1) + 1}',
        'row = {**row, "calls": before.get("calls", 1) + 1}',
        "tests/test_multi_gpu_report.py",
    ),
    "decode rule: the LoRA kernel's 32-key tiles never taken": (
        "kernels/flash_lora_decode.py",
        "        if lora and block_n == 64 and splits(64) >= _SMALL_TILE_SPLITS:",
        "        if False:",
        "tests/test_kernel_decode.py",
    ),
    "decode rule: 32-key tiles at any split count": (
        "kernels/flash_lora_decode.py",
        "        if lora and block_n == 64 and splits(64) >= _SMALL_TILE_SPLITS:",
        "        if lora and block_n == 64:",
        "tests/test_kernel_decode.py",
    ),
    "decode rule: the plans cached without the LoRA flag (a plain call's plan reused for LoRA)": (
        "kernels/flash_lora_decode.py",
        "    key = (bsz, hkv, hq // hkv, cap, d, q.device, lora)",
        "    key = (bsz, hkv, hq // hkv, cap, d, q.device, False)",
        "tests/test_kernel_decode.py",
    ),
    "several GPUs: the per-step host work keeps the graph captures": (
        "eval_suite/multi_gpu_report.py",
        "advance - wait - replay - capture, agent",
        "advance - wait - replay, agent",
        "tests/test_multi_gpu_report.py",
    ),
    "several GPUs: the queue's list schedule gives the next episode to the row that frees up last": (
        "eval_suite/multi_gpu_report.py",
        "        t = heapq.heappop(free) + d\n        heapq.heappush(free, t)",
        "        free.sort()\n        t = free.pop() + d\n        free.append(t)\n        heapq.heapify(free)",
        "tests/test_multi_gpu_report.py",
    ),
    "several GPUs: the queue bound schedules every scheme's episodes as one queue": (
        "eval_suite/multi_gpu_report.py",
        'groups.setdefault(str(r.get("row", r.get("scheme"))), [])',
        'groups.setdefault("all", [])',
        "tests/test_multi_gpu_report.py",
    ),
    "GPU: engine: a graph's capture time not counted": (
        "lragent/engine.py",
        "        self.capture_s += time.perf_counter() - started  # host time: the kernels' compile or load is most of it\n",
        "",
        "tests/test_engine_gpu.py",
    ),
    "fused GEMV: the plain GEMV drops its last K block": (
        "kernels/fused_gemv.py",
        "            else:\n                xin = g.to(tl.float32)",
        "            else:\n                xin = tl.where((k0 + ks < n_in - BLOCK_K)[None, :], g.to(tl.float32), 0.0)",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV: the RMSNorm's weight left out of the GEMV's input": (
        "kernels/fused_gemv.py",
        "        return (nw[None, :] * normed).to(X.dtype.element_ty).to(tl.float32)",
        "        return normed.to(tl.float32)",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV: the residual added for the statistic but not for the product": (
        "kernels/fused_gemv.py",
        "            h = (h + tl.load(RES + at, mask=m2, other=0.0)).to(X.dtype.element_ty)\n        normed",
        "            h = h\n        normed",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV: the new residual stream never written": (
        "kernels/fused_gemv.py",
        "                    tl.store(H_OUT + at, h, mask=m2)",
        "                    pass",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV: SiLU left out of the down projection's input": (
        "kernels/fused_gemv.py",
        "                act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # as _silu_mul_kernel rounds",
        "                act = g",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV: only the first input row computed": (
        "kernels/fused_gemv.py",
        "        r_ok = rows < n_rows\n        if PDL:  # kernels/pdl.py: the previous kernel's output (x, the residual)",
        "        r_ok = rows < 1\n        if PDL:  # kernels/pdl.py: the previous kernel's output (x, the residual)",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV: every row multiplied with the first row's input": (
        "kernels/fused_gemv.py",
        "            acc += tl.dot(xin.to(w.dtype), tl.trans(w))",
        "            acc += tl.dot(tl.broadcast_to(tl.sum(xin, axis=0)[None, :], xin.shape).to(w.dtype), tl.trans(w))",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV in the engine: the q/k/v GEMV normed with the post-attention norm's weight": (
        "lragent/decoder.py",
        "            normed = (h, layer.input_layernorm) if norm_in_qkv else None",
        "            normed = (h, layer.post_attention_layernorm) if norm_in_qkv else None",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV in the engine: the post-attention norm's residual left out": (
        "lragent/decoder.py",
        "                y, h = rms_norm_linear(o, norm.weight, norm.variance_epsilon, gu.weight, residual=h)",
        "                y, _ = rms_norm_linear(o, norm.weight, norm.variance_epsilon, gu.weight, residual=h)",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV in the engine: the down GEMV without the residual stream": (
        "lragent/decoder.py",
        "                return silu_mul_linear(gate, up, down.weight, residual=residual)",
        "                return silu_mul_linear(gate, up, down.weight)",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV rows: the q/k/v and gate/up GEMVs fuse past the switch's row count": (
        "lragent/decoder.py",
        "    if not _fused_step(view, h):",
        '    if not getattr(view, "norm_gemv_rows", 0) or h.numel() // h.shape[-1] > 4:',
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV rows: SiLU in the down GEMV whenever the switch is on, at any row count": (
        "lragent/decoder.py",
        "            silu_in_gemv = _fused_step(view, x2)",
        '            silu_in_gemv = getattr(view, "norm_gemv_rows", 0) > 0',
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV rows: 17-32 rows launched with a 16-row block (rows past 16 never computed)": (
        "kernels/fused_gemv.py",
        "    return 1 if rows == 1 else -(-rows // DOT_ROWS) * DOT_ROWS",
        "    return 1 if rows == 1 else DOT_ROWS",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV rows: a 32-row block keeps the full K block (twice the registers of 16 rows)": (
        "kernels/fused_gemv.py",
        "    while row_block * block_k > TILE_ELEMENTS and block_k > 16:",
        "    while False:",
        "tests/test_fused_gemv.py",
    ),
    "several-GPU report: an eval run one benchmark per call timed by its last part alone": (
        "eval_suite/multi_gpu_report.py",
        '            rows[head] = {"rc": failed[0] if failed else 0, "seconds": sum(r["seconds"] for r in got)}',
        '            rows[head] = {"rc": failed[0] if failed else 0, "seconds": got[-1]["seconds"]}',
        "tests/test_multi_gpu_report.py",
    ),
    "several-GPU report: a failed part of an eval run taken as finished": (
        "eval_suite/multi_gpu_report.py",
        '            rows[head] = {"rc": failed[0] if failed else 0, "seconds": sum(r["seconds"] for r in got)}',
        '            rows[head] = {"rc": 0, "seconds": sum(r["seconds"] for r in got)}',
        "tests/test_multi_gpu_report.py",
    ),
    "timing: the engine's other host work per step keeps the replay calls in": (
        "eval_suite/multi_gpu_report.py",
        "    return tuple(1000 * x / steps for x in (wait, replay, advance - wait - replay - capture, agent))",
        "    return tuple(1000 * x / steps for x in (wait, replay, advance - wait - capture, agent))",
        "tests/test_multi_gpu_report.py",
    ),
    "timing: the wait for the device never counted": (
        "lragent/engine.py",
        "        self.wait_s += time.perf_counter() - waited",
        "        pass",
        "tests/test_engine.py",
    ),
    "fused GEMV in the engine: o_proj on the Triton GEMV at steps wider than the switch's rows": (
        "lragent/decoder.py",
        "    return _fused_step(view, o)",
        '    return getattr(view, "norm_gemv_rows", 0) > 0',
        "tests/test_fused_gemv.py -k engine",
    ),
    "fused GEMV in the engine: o_proj's GEMV reads its weight's rows in reverse": (
        "lragent/decoder.py",
        "            o = gemv(o, attn.o_proj.weight)  # one launch",
        "            o = gemv(o, attn.o_proj.weight.flip(0).contiguous())  # one launch",
        "tests/test_fused_gemv.py -k engine",
    ),
    "fused GEMV rows: several rows launched with the one-row configs (16 outputs per program, 4x the input re-reads)": (
        "kernels/fused_gemv.py",
        "    if rows > 1:\n        return ROWS_CONFIG\n",
        "",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV deferred sum: each tile's products kept, not added to the running sum": (
        "kernels/fused_gemv.py",
        "        return acc2 + w.to(tl.float32) * xin",
        "        return w.to(tl.float32) * xin",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV deferred sum: a config's deferred flag accepted at any value": (
        "eval_suite/bench_fused_gemv.py",
        "    if config.deferred not in (0, 1):",
        "    if False:",
        "tests/test_fused_gemv.py",
    ),
    "fused GEMV rows: a switch past MAX_ROWS accepted": (
        "kernels/fused_gemv.py",
        "    if not raw.isdigit() or int(raw) > MAX_ROWS:",
        "    if not raw.isdigit():",
        "tests/test_fused_gemv.py tests/test_decode_floor.py",
    ),
    "bench decode: the environment's engine switches checked only at the first launch (after the model loads)": (
        "eval_suite/bench_decode.py",
        "    for name in ENGINE_SWITCHES:\n        _switch_value(name)\n",
        "",
        "tests/test_decode_floor.py",
    ),
    "decode plans: the environment left as the last plan set it": (
        "eval_suite/bench_decode.py",
        "    saved = {k: os.environ.get(k) for k in names}",
        "    saved = {}",
        "tests/test_profile_decode.py tests/test_decode_floor.py",
    ),
    "decode plans: a plan's switches not applied (every plan runs the environment's)": (
        "eval_suite/bench_decode.py",
        "            os.environ[ENGINE_SWITCHES[name][0]] = str(value)",
        "            pass",
        "tests/test_profile_decode.py tests/test_decode_floor.py",
    ),
    "bench decode --repeats: each plan's repeats back to back (A, A, B, B)": (
        "eval_suite/bench_decode.py",
        "    return [(rep, spec) for rep in range(repeats) for spec in plans]",
        "    return [(rep, spec) for spec in plans for rep in range(repeats)]",
        "tests/test_decode_floor.py",
    ),
    "bench decode --repeats: the turn column left out of the table": (
        "eval_suite/bench_decode.py",
        '            *([str(r.get("repeat", "–"))] if with_turn else []),',
        "",
        "tests/test_decode_floor.py",
    ),
    "fused GEMV bench: one weight timed over and over (L2-hot)": (
        "eval_suite/bench_fused_gemv.py",
        "    return max(1, -(-2 * l2_bytes // max(1, weight_bytes)))",
        "    return 1",
        "tests/test_fused_gemv.py",
    ),
    "multi-GPU report: the shards' balance read from the fastest shard": (
        "eval_suite/multi_gpu_report.py",
        '"slowest_over_mean": max(loops) / (sum(loops) / len(loops))',
        '"slowest_over_mean": min(loops) / (sum(loops) / len(loops))',
        "tests/test_multi_gpu_report.py",
    ),
    "work queue: a claim that always wins (not exclusive)": (
        "eval_suite/work_queue.py",
        "            fd = os.open(self.folder / claim_name(key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)",
        "            fd = os.open(self.folder / claim_name(key), os.O_CREAT | os.O_WRONLY, 0o644)",
        "tests/test_work_queue.py",
    ),
    "work queue: a relaunch keeps the killed launch's claims": (
        "eval_suite/work_queue.py",
        "    shutil.rmtree(folder, ignore_errors=True)",
        "    pass",
        "tests/test_work_queue.py",
    ),
    "work queue: a shard ignores what the shard beside it finished": (
        "eval_suite/run_eval.py",
        "        elsewhere |= {record_key(r) for r in read_episodes(log)}",
        "        pass",
        "tests/test_work_queue.py",
    ),
    "work queue: the launcher gives its shards no queue": (
        "eval_suite/shard_launch.py",
        '"--work_queue",\n               str(queue), ',
        "",
        "tests/test_work_queue.py",
    ),
    "concurrent schemes: the prefill timing waits for the whole device, not the engine's stream": (
        "lragent/engine.py",
        "            torch.cuda.current_stream(self.device).synchronize()",
        "            torch.cuda.synchronize(self.device)",
        "tests/test_engine_properties.py -k prefill_timing",
    ),
    "concurrent schemes: an unused reservation kept past the run that follows it": (
        "eval_suite/batched_executor.py",
        "        self._reserved.clear()  # a reservation serves the run that follows it; unused, its memory goes back\n",
        "",
        "tests/test_batched_executor_properties.py -k reservation",
    ),
    "bench eval: the jobs run one at a time whatever --concurrent says": (
        "eval_suite/bench_eval.py",
        "            while queue and len(running) < concurrent:",
        "            while queue and not running:",
        "tests/test_bench_eval.py",
    ),
    "bench eval: episodes per GPU-second over the jobs' own walls added up": (
        "eval_suite/bench_eval.py",
        '"episodes_per_gpu_s": episodes / wall,',
        '"episodes_per_gpu_s": episodes / sum(s["wall_s"] for s in summaries.values()),',
        "tests/test_bench_eval.py",
    ),
    "bench eval: episodes compared without their predictions": (
        "eval_suite/bench_eval.py",
        'SAME_FIELDS = ("prediction", "actions", "num_tokens", "seed")',
        'SAME_FIELDS = ("actions", "num_tokens", "seed")',
        "tests/test_bench_eval.py",
    ),
    "bench eval: a failed job's exit status ignored": (
        "eval_suite/bench_eval.py",
        '    return 0 if all(s["rc"] == 0 for s in summaries.values()) else 1',
        "    return 0",
        "tests/test_bench_eval.py",
    ),
    "concurrent schemes: every task run on the first scheme's engine": (
        "eval_suite/batched_executor.py",
        "                by_scheme.setdefault(str(task.scheme), []).append(task)",
        '                by_scheme.setdefault("one", []).append(task)',
        "tests/test_batched_executor.py -k concurrent",
    ),
    "concurrent schemes: the memory plan counts the hungriest scheme alone": (
        "lragent/memory_plan.py",
        "        if concurrent and len(plans) > 1:",
        "        if False:",
        "tests/test_memory_plan.py -k concurrent",
    ),
    "decisive study: a job of several schemes done when its first row is": (
        "eval_suite/study_jobs.py",
        '        rows = job.meta.get("rows") or [job.meta.get("row", job.meta.get("scheme"))]',
        '        rows = (job.meta.get("rows") or [job.meta.get("row", job.meta.get("scheme"))])[:1]',
        "tests/test_study_decide.py",
    ),
    "work queue: the batched executor claims every task before any row is free": (
        "eval_suite/batched_executor.py",
        (
            "        return _Lane(eng, list(tasks), list(range(rows)), stream)",
            "            if not task.take():  # a shard of a shared queue took it first\n                continue\n",
        ),
        ("        return _Lane(eng, [t for t in tasks if t.take()], list(range(rows)), stream)", ""),
        "tests/test_batched_executor_properties.py",
    ),
    "work queue: the sequential executor runs a task another shard took": (
        "eval_suite/executors.py",
        "            if not task.take():\n                continue\n",
        "",
        "tests/test_work_queue.py",
    ),
    "device guard: a launch on another GPU not switched to it": (
        "kernels/device_guard.py",
        "        if index is not None and index != torch.cuda.current_device():",
        "        if False:",
        "tests/test_device_guard.py",
    ),
    "device guard: silu_mul launched without the guard": (
        "kernels/fused_ops.py",
        "@on_tensor_device\ndef silu_mul(",
        "def silu_mul(",
        "tests/test_device_guard.py",
    ),
    "PEFT check: every role compared with the first role's logits": (
        "eval_suite/peft_check.py",
        "            got = lm(ids, [role]).float()",
        "            got = lm(ids, [cfg.roles[0]]).float()",
        "tests/test_peft_check.py",
    ),
    "PEFT check: the PEFT adapter never switched to the role": (
        "eval_suite/peft_check.py",
        "            peft_model.set_adapter(role)",
        "            pass",
        "tests/test_peft_check.py",
    ),
    "several-GPU report: the seed spread is the smallest seed difference": (
        "eval_suite/multi_gpu_report.py",
        'res["seed_spread_last"] = max(abs(',
        'res["seed_spread_last"] = min(abs(',
        "tests/test_multi_gpu_report.py",
    ),
    "engine: a one-character stop of several UTF-8 bytes never checked on the text": (
        "lragent/engine.py",
        'return any(len(s.encode("utf-8")) > 1 for s in stops)',
        "return any(len(s) > 1 for s in stops)",
        "tests/test_engine_properties.py",
    ),
    "engine: a token that is both an EOS and a stop's end reported as a stop": (
        "lragent/engine.py",
        '                reason = "stop" if reason == "length" else reason',
        '                reason = "stop"',
        "tests/test_engine_properties.py",
    ),
    "engine: an EOS drawn after a stop string before the next sync wins over the stop": (
        "lragent/engine.py",
        (
            "        if req.stop and StopTokenIndex.needs_text_check(req.stop):\n",
            '        if eos_at is not None:\n            gen, reason = gen[: eos_at + 1], "eos"\n',
        ),
        (
            "        if False:\n",
            '        if eos_at is not None:\n            gen, reason = gen[: eos_at + 1], "eos"\n'
            "        elif req.stop and StopTokenIndex.needs_text_check(req.stop):\n"
            "            gen = self._trim_to_stop(gen, req.stop)\n",
        ),
        "tests/test_engine_properties.py",
    ),
    "inference FLOPs: causal pairs without the diagonal": (
        "eval_suite/model_flops.py",
        "    return (end * (end + 1) - start * (start + 1)) // 2",
        "    return (end * (end - 1) - start * (start - 1)) // 2",
        "tests/test_model_flops.py",
    ),
    "inference FLOPs: the LR prefill counted as a full forward": (
        "eval_suite/model_flops.py",
        "            total += span_flops(shape, op.start, op.end, skip_kv=True)",
        "            total += span_flops(shape, op.start, op.end)",
        "tests/test_model_flops.py",
    ),
    "inference FLOPs: a decode forward for the last generated token too": (
        "eval_suite/model_flops.py",
        "    steps = max(0, generated - 1)",
        "    steps = max(0, generated)",
        "tests/test_model_flops.py",
    ),
    "sampling: uniform noise reaches 1.0 (infinite Gumbel noise draws a banned token)": (
        "lragent/sampling.py",
        "    return u.clamp_max(1.0 - 2.0**-24)",
        "    return u",
        "tests/test_sampling_properties.py",
    ),
    "study archive: file times kept (a commit rewrites every set)": (
        "eval_suite/study.py",
        '    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # same files, same bytes',
        '    info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""',
        "tests/test_study.py",
    ),
    "study archive: adapter weights kept": (
        "eval_suite/study.py",
        '    if "adapters" in parts or "driver.json" in parts:',
        '    if "driver.json" in parts:',
        "tests/test_study.py",
    ),
    "study archive: fidelity left out of its set": (
        "eval_suite/study.py",
        '    for kind in ("train", "eval", "fidelity"):\n        for d in sorted((root / kind).glob("*"))',
        '    for kind in ("train", "eval"):\n        for d in sorted((root / kind).glob("*"))',
        "tests/test_study.py",
    ),
    "zero-shot: the chance rate from the mean option count": (
        "eval_suite/zero_shot.py",
        '        out["chance"] = 100 * sum(1 / r["n_choices"] for r in records) / len(records)',
        '        out["chance"] = 100 / (sum(r["n_choices"] for r in records) / len(records))',
        "tests/test_zero_shot.py",
    ),
    "zero-shot: a rerun asks every question again": (
        "eval_suite/zero_shot.py",
        "            if qid in done:\n                continue",
        "            pass",
        "tests/test_zero_shot.py",
    ),
    "zero-shot: an 'Answer:' prefix kept when capitalised": (
        "eval_suite/zero_shot.py",
        '    if line.lower().startswith("answer:"):',
        '    if line.startswith("answer:"):',
        "tests/test_zero_shot.py",
    ),
    "shared card: the share ignores what this process already holds": (
        "lragent/device_share.py",
        "share = max(0, int(fraction * total) - held_memory(device))",
        "share = max(0, int(fraction * total))",
        "tests/test_device_share.py",
    ),
    "shared card: out of memory retries at the same batch": (
        "eval_suite/run_eval.py",
        "                batch = max(1, batch // 2)",
        "                batch = max(1, batch)",
        "tests/test_device_share.py",
    ),
    "shared card: out of memory in a command is a traceback": (
        "lragent/command.py",
        "        if not is_oom(exc):\n            raise",
        "        raise",
        "tests/test_device_share.py",
    ),
    "shared card: auto after loading still counts the model as to be allocated": (
        "lragent/memory_plan.py",
        "            worst = dataclasses.replace(worst, model_bytes=0)",
        "            pass",
        "tests/test_device_share.py",
    ),
    "shared card: the caches sized under the lock are not the ones the run uses": (
        "eval_suite/batched_executor.py",
        "            eng = reserved[1] if reserved is not None and reserved[0] >= rows else self._engine(scheme, rows)",
        "            eng = self._engine(scheme, rows)",
        "tests/test_device_share.py",
    ),
    "bench trace: no memory check before the model loads": (
        "eval_suite/bench_trace.py",
        "    check_trace_memory(model, schemes, contexts, dt, device, rank, droidspeak_layers)  # before the model loads",
        "",
        "tests/test_device_share.py -k bench_trace",
    ),
    "accuracy model: a part's hash taken over its first chunk only": (
        "lragent/accuracy_model.py",
        "    for chunk in chunks:\n        h.update(chunk)\n        n += len(chunk)",
        "    for i, chunk in enumerate(chunks):\n        if i == 0:\n            h.update(chunk)\n        n += len(chunk)",
        "tests/test_accuracy_model.py",
    ),
    "accuracy model: a refused join leaves its half-written file": (
        "lragent/accuracy_model.py",
        "        tmp.unlink(missing_ok=True)",
        "        pass",
        "tests/test_accuracy_model.py",
    ),
    "accuracy model: the join checks no part's own hash": (
        "lragent/accuracy_model.py",
        "                _check_part(src, *_digest(copied()))",
        "                _check_part(src, _digest(copied())[0])",
        "tests/test_accuracy_model.py",
    ),
    "accuracy model: a joined GGUF's hash not checked": (
        "lragent/accuracy_model.py",
        "    if digest != GGUF_SHA256:\n        raise",
        "    if False:\n        raise",
        "tests/test_accuracy_model.py",
    ),
    "accuracy model: the last part pinned at a full part's size": (
        "lragent/accuracy_model.py",
        "PART_BYTES if i < n - 1 else last, h)",
        "PART_BYTES, h)",
        "tests/test_accuracy_model.py",
    ),
    "recipe sweep: a point's evaluation ranked after every training": (
        "eval_suite/study.py",
        "                                  pi * 10 + bi + 0.5, meta)",
        "                                  100 + pi * 10 + bi, meta)",
        "tests/test_study.py",
    ),
    "recipe sweep: the point's learning rate not given to the roles": (
        "eval_suite/study.py",
        'model.update(lr=lr, shared_a_lr=lr, role_lr={role: lr for role in model["roles"]})',
        "model.update(lr=lr, shared_a_lr=lr)",
        "tests/test_study.py",
    ),
    "study: fidelity jobs without the profile's --model": (
        "eval_suite/study.py",
        '"fidelity", "--benchmark", bench, *profile.model_args(), *adapters,',
        '"fidelity", "--benchmark", bench, *adapters,',
        "tests/test_study.py",
    ),
    "sweep report: the first epoch's val loss": (
        "eval_suite/study_report.py",
        'float(vals[-1]["val/loss"]) if vals else None',
        'float(vals[0]["val/loss"]) if vals else None',
        "tests/test_study.py",
    ),
    "sweep report: answer validity looked up per row (always None)": (
        "eval_suite/study_report.py",
        'entry["valid"] = validity(records)["rate"] if records else None',
        'entry["valid"] = (validity(records).get("non_shared") or {}).get("rate") if records else None',
        "tests/test_study.py",
    ),
    "study driver: a later job takes the room a blocked one waits for": (
        "eval_suite/study.py",
        "                blocked = True\n                continue",
        "                continue",
        "tests/test_study.py -k strict_priority",
    ),
    "study driver: trainings not capped per GPU": (
        "eval_suite/study.py",
        '            if job.kind == "train" and min(trains) >= max_train:\n                continue',
        "            if False:\n                continue",
        "tests/test_study.py -k capped",
    ),
    "study driver: a killed driver's running job started again": (
        "eval_suite/study.py",
        "    for name, pid in _orphans(root, jobs).items():",
        "    for name, pid in {}.items():",
        "tests/test_study.py -k killed_driver",
    ),
    "study driver: an exited, unreaped job counted as running": (
        "eval_suite/study.py",
        '    if state == "Z":  # exited, not yet reaped by its parent\n        return False',
        "",
        "tests/test_study.py -k killed_driver",
    ),
    "study driver: a training whose rows are all kept runs again": (
        "eval_suite/study.py",
        '    if dependents and all(is_done(j, root) for j in dependents):\n        return "unneeded"',
        "",
        "tests/test_study.py -k rows_are_all_kept",
    ),
    "study: a set's rows ranked after later sets' trainings": (
        "eval_suite/study.py",
        "                prio = si * 10 + 2 + bi * 0.1 + ci * 0.01",
        "                prio = 100 + si * 10 + bi * 0.1 + ci * 0.01",
        "tests/test_study.py -k later_sets_train",
    ),
    "GPU-suite record: a parameter id holding '::' split as if it named a class": (
        "scripts/gpu_tests_record.py",
        '    head, bracket, params = node_id.partition("[")  # a parameter id may itself hold "::"',
        '    head, bracket, params = node_id, "", ""',
        "tests/test_gpu_tests_record.py",
    ),
    "GPU-suite record: a test class dropped from the JUnit key": (
        "scripts/gpu_tests_record.py",
        'return ".".join([module.replace("/", "."), *parts[:-1]]), parts[-1] if parts else ""',
        'return module.replace("/", "."), parts[-1] if parts else ""',
        "tests/test_gpu_tests_record.py",
    ),
    "GPU-suite record: not-reached tests left out of the markdown": (
        "scripts/gpu_tests_record.py",
        "lines.append(f\"- {r['run']} did not reach: `{t}`\")",
        "pass",
        "tests/test_gpu_tests_record.py",
    ),
    "cross-role batches, bundled data: an absorbed row's plain predictions read one position late": (
        "lit_modules/multi_lora_module.py",
        "moved_index = [b * t + p for j, b in plan.items() for p in range(ctx[j] - 1, lengths[j] - 1)]",
        "moved_index = [b * t + p for j, b in plan.items() for p in range(ctx[j], lengths[j])]",
        "tests/test_cross_role_batches.py -k real_token",
    ),
    "bench train: the PEFT interval pairs the loop's one round with lragent's rounds unaveraged": (
        "eval_suite/bench_train.py",
        'paired_ratio_interval(_per_batch_mean(r["step_seconds"], r.get("rounds", 1)), peft["step_seconds"])',
        'paired_ratio_interval(r["step_seconds"], peft["step_seconds"])',
        "tests/test_bench_train.py -k peft_loop_gets",
    ),
    "bench train: the PEFT interval upside down (lragent's time over the loop's)": (
        "eval_suite/bench_train.py",
        'paired_ratio_interval(_per_batch_mean(r["step_seconds"], r.get("rounds", 1)), peft["step_seconds"])',
        'paired_ratio_interval(peft["step_seconds"], _per_batch_mean(r["step_seconds"], r.get("rounds", 1)))',
        "tests/test_bench_train.py -k peft_loop_gets",
    ),
    "bench train: the ratio's interval resamples the two settings' batches independently (unpaired)": (
        "eval_suite/bench_train.py",
        "    ratios = other[draw].sum(1) / zero[draw].sum(1)",
        "    ratios = other[draw].sum(1) / zero[draw.roll(1, 0)].sum(1)",
        "tests/test_bench_train.py -k paired_interval",
    ),
    "bench train: the ratio's interval over rounds, not batches (a batch's rounds not averaged)": (
        "eval_suite/bench_train.py",
        "    zero = torch.tensor(_per_batch_mean(zero_seconds, rounds), dtype=torch.float64)",
        "    zero = torch.tensor(zero_seconds[:n], dtype=torch.float64)",
        "tests/test_bench_train.py -k paired_interval",
    ),
    "bench train: warm rounds pooled with the timed ones": (
        "eval_suite/bench_train.py",
        "(warm if rnd < warm_rounds else measured).append(this_round)",
        "measured.append(this_round)\n                warm.append(this_round) if rnd < warm_rounds else None",
        "tests/test_bench_train.py -k warm_rounds",
    ),
    "bench train: max_tokens not passed to the data": (
        "eval_suite/bench_train.py",
        "cross_role_min_share=cross_role_min_share, max_tokens=max_tokens,",
        "cross_role_min_share=cross_role_min_share,",
        "tests/test_bench_train.py -k warm_rounds",
    ),
    "cross-role batches: min share checked per link, not over the chain": (
        "datamodules/cross_role_prefixes.py",
        ">= min_length_share * len(examples[root(c)].input_ids)",
        ">= min_length_share * len(examples[c].input_ids)",
        "tests/test_cross_role_batches.py -k min_share",
    ),
    "cross-role batches: min share not passed to the groups": (
        "datamodules/role_examples.py",
        "train, self.batch_size if self.max_tokens is None else 4, self.cross_role_min_share",
        "train, self.batch_size if self.max_tokens is None else 4",
        "tests/test_cross_role_batches.py -k min_share",
    ),
    "cross-role batches: chains longer than the batch": (
        "datamodules/cross_role_prefixes.py",
        "and size[root(j)] + size[root(c)] <= max_group",
        "",
        "tests/test_cross_role_batches.py -k groups",
    ),
    "bench train: absorbed rows never counted": (
        "lit_modules/multi_lora_module.py",
        'self.absorbed_rows_seen = getattr(self, "absorbed_rows_seen", 0) + len(plan)',
        'self.absorbed_rows_seen = getattr(self, "absorbed_rows_seen", 0)',
        "tests/test_bench_train.py -k absorbed",
    ),
    "cross-role batches: an absorbed row's plain predictions read one position late": (
        "lit_modules/multi_lora_module.py",
        "moved_index = [b * t + p for j, b in plan.items() for p in range(ctx[j] - 1, lengths[j] - 1)]",
        "moved_index = [b * t + p for j, b in plan.items() for p in range(ctx[j], lengths[j])]",
        "tests/test_cross_role_batches.py",
    ),
    "cross-role batches: a row absorbed into a sequence whose producer is not its role": (
        "lit_modules/multi_lora_module.py",
        "if j not in plan and roles[j] == producers[b] and k <= split[b]:",
        "if j not in plan and k <= split[b]:",
        "tests/test_cross_role_batches.py -k absorbed",
    ),
    "cross-role batches: a row absorbed past the consumer's split": (
        "lit_modules/multi_lora_module.py",
        "if j not in plan and roles[j] == producers[b] and k <= split[b]:",
        "if j not in plan and roles[j] == producers[b]:",
        "tests/test_cross_role_batches.py -k absorbed",
    ),
    "cross-role batches: the plain pass keeps the absorbed rows' targets in order of the batch, not of the kept rows": (
        "lit_modules/multi_lora_module.py",
        "plain_targets = [q for r in keep for q in range(offsets[r], offsets[r + 1])]",
        "plain_targets = [q for r in range(len(lengths)) for q in range(offsets[r], offsets[r + 1])][: len(plain_index)]",
        "tests/test_cross_role_batches.py -k absorbed",
    ),
    "cross-role batches: a group split over two batches": (
        "datamodules/role_examples.py",
        "                if len(batches[-1]) + len(grp) > self.batch_size:\n                    batches.append([])\n                batches[-1] += grp",
        "                for i in grp:\n                    if len(batches[-1]) >= self.batch_size:\n                        batches.append([])\n                    batches[-1].append(i)",
        "tests/test_cross_role_batches.py -k groups",
    ),
    "cross-role batches: a source of the consumer's own role": (
        "datamodules/cross_role_prefixes.py",
        "source.role_id != consumer.role_id\n        and _can_source(source)",
        "_can_source(source)",
        "tests/test_cross_role_batches.py",
    ),
    "cross-role batches: the prefix producer ignores the split": (
        "lit_modules/multi_lora_module.py",
        "                fits = [j for j, k in found if k <= split[b]]\n                if fits:\n                    drawn[b] = roles[fits[0]]",
        "                fits = [j for j, k in found]\n                if fits:\n                    drawn[b] = roles[fits[0]]",
        "tests/test_cross_role_batches.py -k producer",
    ),
    "several-GPU report: a distributed run's tokens/s taken from rank 0 alone": (
        "eval_suite/multi_gpu_report.py",
        '"tokens_per_s": s.get("global_tokens_per_s", s.get("tokens_per_s")),',
        '"tokens_per_s": s.get("tokens_per_s"),',
        "tests/test_multi_gpu_report.py",
    ),
    "several-GPU report: the speed-up inverted": (
        "eval_suite/multi_gpu_report.py",
        'fsdp[f"{key}_speedup_tokens_per_s"] = sn["tokens_per_s"] / one["tokens_per_s"]',
        'fsdp[f"{key}_speedup_tokens_per_s"] = one["tokens_per_s"] / sn["tokens_per_s"]',
        "tests/test_multi_gpu_report.py",
    ),
    "several-GPU report: a phase skipped at the deadline breaks the report": (
        "eval_suite/multi_gpu_report.py",
        '"rc": int(rc) if rc.lstrip("-").isdigit() else rc,',
        '"rc": int(rc),',
        "tests/test_multi_gpu_report.py",
    ),
    "two-piece attention: the producer's values with the consumer's B": (
        "lragent/attention.py",
        "v_prod = _role_values(v_rows, lr, lora_b, layout.producer, scaling)",
        "v_prod = _role_values(v_rows, lr, lora_b, layout.consumer, scaling)",
        "tests/test_two_piece_attention.py",
    ),
    "two-piece attention: ΔB with the producer and consumer swapped": (
        "lragent/attention.py",
        "return ((heads[layout.consumer] - heads[layout.producer]) * scaling).to(dt)",
        "return ((heads[layout.producer] - heads[layout.consumer]) * scaling).to(dt)",
        "tests/test_two_piece_attention.py",
    ),
    "two-piece attention: the attention's output not restored before its backward": (
        "lragent/attention.py",
        "            restore_rows(out, rows, saved)\n",
        "            pass\n",
        "tests/test_two_piece_attention.py -k 'own_output or (equals_the_per_query and float32)'",
    ),
    "two-piece attention: the corrected rows not put back after the attention's backward": (
        "lragent/attention.py",
        "        if redo is not None:\n            restore_rows(*redo)",
        "        if redo is not None:\n            pass",
        "tests/test_two_piece_attention.py -k under_backward",
    ),
    "two-piece attention: the correction's dq rows never added": (
        "lragent/attention.py",
        "            add_dq_rows(gq, *item)",
        "            pass",
        "tests/test_two_piece_attention.py",
    ),
    "two-piece attention: B's gradient from the correction given to the consumer only": (
        "lragent/attention.py",
        ".index_add_(0, layout.producer, -x)",
        "",
        "tests/test_two_piece_attention.py",
    ),
    "two-piece attention: padding rows past the end corrected like consumer rows": (
        "lragent/attention.py",
        "            starts, stops = torch.stack([split.long(), ends.to(split.device, torch.long)]).tolist()",
        "            starts, stops = split.tolist(), [length] * split.numel()",
        "tests/test_two_piece_attention.py -k 'packed or padding'",
    ),
    "training step: the shared pass laid out from the device tensors (a device sync per step)": (
        "lit_modules/multi_lora_module.py",
        "        return torch.tensor(host[key], dtype=torch.long) if key in host else batch.get(key)",
        "        return batch.get(key)",
        "tests/test_two_piece_attention.py -k host_copies",
    ),
    "consumer-row kernel: a row's own key masked out": (
        "kernels/consumer_rows.py",
        'qk = tl.where(n[None, :] <= pos[:, None], qk, float("-inf"))',
        'qk = tl.where(n[None, :] < pos[:, None] + (pos[:, None] == 0), qk, float("-inf"))',
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "consumer-row kernel: dK skips the first row block that sees the tile": (
        "kernels/consumer_rows.py",
        "for m0 in range((first // BLOCK_M) * BLOCK_M, GROUP * count, BLOCK_M):",
        "for m0 in range((first // BLOCK_M) * BLOCK_M + BLOCK_M, GROUP * count, BLOCK_M):",
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "consumer-row kernel: ΔB of the other KV head": (
        "kernels/consumer_rows.py",
        "ptrs = DB + b64 * stride_db_b + g.to(tl.int64) * stride_db_h",
        "ptrs = DB + b64 * stride_db_b + ((g + 1) % 2).to(tl.int64) * stride_db_h",
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "consumer-row kernel: the forward's merge weights the key splits' sums without their max": (
        "kernels/consumer_rows.py",
        "                w = tl.math.exp2(tl.load(WS_M + ws, mask=row_ok, other=-1.0e30) - m_all)",
        "                w = 1.0",
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "consumer-row kernel: the split dQ added into the queries' gradient without its last split": (
        "kernels/consumer_rows.py",
        "            for s in range(0, n_splits):\n                ws = s * n_row_heads + row64\n                dq +=",
        "            for s in range(0, n_splits - 1):\n                ws = s * n_row_heads + row64\n                dq +=",
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "consumer-row kernel: c = rowsum(u ∘ O_lr) halved": (
        "kernels/consumer_rows.py",
        "        c = tl.sum(u * o_lr, 1)",
        "        c = tl.sum(u * o_lr, 1) * 0.5",
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "consumer-row kernel: dV_lr without the causal mask": (
        "kernels/consumer_rows.py",
        "p = tl.where((n[None, :] <= pos[:, None]) & row_ok[:, None], p, 0.0)",
        "p = tl.where(row_ok[:, None], p, 0.0)",
        "tests/test_two_piece_attention.py -k interpreter",
    ),
    "lambda_mode sample: the shared term with probability 1 - λ": (
        "lit_modules/multi_lora_module.py",
        "            lam = 1.0 if coin < lam else 0.0",
        "            lam = 1.0 if coin > lam else 0.0",
        "tests/test_training.py -k sample_mode",
    ),
    "lambda_mode sample: ignored (both terms every step)": (
        "lit_modules/multi_lora_module.py",
        '        if self.train_config.lambda_mode == "sample" and 0 < lam < 1:',
        "        if False:",
        "tests/test_training.py -k sample_mode",
    ),
    "bench train: a sampled-λ step counted as two passes": (
        "eval_suite/bench_train.py",
        '    if lambda_mode == "sample":\n        return one\n',
        "",
        "tests/test_bench_train.py -k 'flop_count or runs_on_a_tiny'",
    ),
    "converted-model cache: a finished copy removed under a reader by a later conversion": (
        "lragent/converted_cache.py",
        "        if is_converted(target):\n            return\n        if target.exists():",
        "        if target.exists():",
        "tests/test_converted_cache.py",
    ),
    "decode: the MLP's residual dropped by the down projection's GEMM": (
        "lragent/decoder.py",
        "flat = torch.addmm(residual.flatten(0, -2), act.flatten(0, -2), down.weight.t())",
        "flat = torch.addmm(residual.flatten(0, -2), act.flatten(0, -2), down.weight.t(), beta=0)",
        "tests/test_decode_fusion.py",
    ),
    "answer sentence names the wrong option": (
        "datamodules/answer_thoughts.py",
        "        i = LETTERS.index(letter)",
        "        i = (LETTERS.index(letter) + 1) % 2",
        "tests/test_answer_thoughts.py",
    ),
    "plan thought examples keep the bare thought": (
        "datamodules/answer_thoughts.py",
        "    if new_input.endswith(THOUGHT) and new_output in letter_of",
        "    if False and new_output in letter_of",
        "tests/test_answer_thoughts.py",
    ),
    "answer sentence appended twice": (
        "datamodules/answer_thoughts.py",
        "    return thought if thought.endswith(sentence) else thought + sentence",
        "    return thought + sentence",
        "tests/test_answer_thoughts.py",
    ),
    "plan action-type example reads the bare thought": (
        "datamodules/answer_thoughts.py",
        '    if new_input.endswith(_PLAN_ACTION) and new_output.strip().startswith("Finish"):',
        "    if False:",
        "tests/test_answer_thoughts.py",
    ),
    "fed prefill token goes one position too far": (
        "lragent/engine.py",
        "self._load_row(row, request, pos=op.start)",
        "self._load_row(row, request, pos=op.start + 1)",
        "tests/test_engine.py -k prefill_in_decode",
    ),
    "fed prefill tokens counted as generated": (
        "lragent/engine.py",
        "        gen = act & ~forcing\n",
        "        gen = act\n",
        "tests/test_engine.py tests/test_batched_executor.py -k 'prefill_in_decode or 32'",
    ),
    "fed prefill forward not recorded": (
        "lragent/engine.py",
        "        self.scheme.record(traj, request.role, op)\n        self.d_active[row] = True",
        "        self.d_active[row] = True",
        "tests/test_engine.py -k prefill_in_decode",
    ),
    "a fed end-of-sequence token ends the turn": (
        "lragent/engine.py",
        "done = gen & (hit |",
        "done = act & (hit |",
        "tests/test_engine.py -k prefill_in_decode",
    ),
    "catch-up as the wrong role": (
        "lragent/engine.py",
        "        role_t = torch.tensor([role], device=self.device)\n        if isinstance(op, Recompute):",
        "        role_t = torch.tensor([role if isinstance(op, Forward) else 0], device=self.device)\n        if isinstance(op, Recompute):",
        "tests/test_engine.py -k reference",
    ),
    "droidspeak recomputes one layer too many": (
        "lragent/engine.py",
        "self.dec.run_view(h, rotary, role_t, view, layers=range(a, b))",
        "self.dec.run_view(h, rotary, role_t, view, layers=range(a, min(b + 1, self.dec.n_layers)))",
        "tests/test_engine.py -k reference",
    ),
    "droidspeak recomputes one layer too few": (
        "lragent/engine.py",
        "self.dec.run_view(h, rotary, role_t, view, layers=range(a, b))",
        "self.dec.run_view(h, rotary, role_t, view, layers=range(a, max(b - 1, a + 1)) if b - a > 1 else range(a, b - 1))",
        "tests/test_engine.py -k reference",
    ),
    "catch-up RoPE positions restart at 0": (
        "lragent/engine.py",
        "        rotary = (cos_t[positions][None], sin_t[positions][None])\n        role_t = torch.tensor([role], device=self.device)\n",
        "        positions = positions - (0 if isinstance(op, Forward) else start)\n        rotary = (cos_t[positions][None], sin_t[positions][None])\n        role_t = torch.tensor([role], device=self.device)\n",
        "tests/test_engine.py -k reference",
    ),
    "seen not clipped by a truncation": (
        "lragent/sharing.py",
        "        traj.seen = {r: min(s, n) for r, s in traj.seen.items()}",
        "        traj.seen = dict(traj.seen)",
        "tests/test_engine.py -k reference",
    ),
    "LoRA scaling wrong in forward and merge alike": (
        "lragent/multi_lora.py",
        "        self.scaling = alpha / rank",
        "        self.scaling = alpha / rank ** 0.5",
        "tests/test_multi_lora.py",
    ),
    "low-rank term uses role 0's B (prefill)": (
        "lragent/attention.py",
        "    b_sel = b_heads[role_ids]  # (B, H_kv, r, D)",
        "    b_sel = b_heads[torch.zeros_like(role_ids)]  # (B, H_kv, r, D)",
        "tests/test_engine.py -k reference",
    ),
    "low-rank term uses role 0's B (decode)": (
        "lragent/cache_views.py",
        "    b_sel = lora_b_per_head(lora_b, h_kv)[role_ids]  # (B, H_kv, r, D)",
        "    b_sel = lora_b_per_head(lora_b, h_kv)[torch.zeros_like(role_ids)]  # (B, H_kv, r, D)",
        "tests/test_engine.py -k reference",
    ),
    "RoPE kernel: wrong sign of the rotated half": (
        "kernels/fused_ops.py",
        "        o1 = ((x1 * c1).to(dt) + (-x2 * s1).to(dt)).to(dt)",
        "        o1 = ((x1 * c1).to(dt) + (x2 * s1).to(dt)).to(dt)",
        "tests/test_fused_ops.py",
    ),
    "PEFT import puts each role's B in the next role": (
        "lragent/adapters_io.py",
        '        _copy(module.lora_B[rid], b, f"{peft_dir}: {name} lora_B")',
        '        _copy(module.lora_B[(rid + 1) % len(module.lora_B)], b, f"{peft_dir}: {name} lora_B")',
        "tests/test_shipped_adapters.py",
    ),
    "finished rows keep counting between host checks (graph replay)": (
        "lragent/engine.py",
        "        count.add_(step)\n",
        "        count.add_(torch.ones_like(step))\n",
        "tests/test_engine.py -k graph_replay",
    ),
    "similarity: cosine over the whole sequence instead of per token": (
        "eval_suite/similarity.py",
        "    cos = (u * v).sum(-1) / denom\n",
        "    cos = ((u * v).sum() / (u.norm() * v.norm())).expand(u.shape[0])\n",
        "tests/test_similarity.py",
    ),
    "similarity: L1 of the adapter output as a mean instead of a sum over entries": (
        "eval_suite/similarity.py",
        '        out["l1_adapter"].append(adapter.double().abs().sum(-1).mean(-1).tolist())',
        '        out["l1_adapter"].append(adapter.double().abs().mean(-1).mean(-1).tolist())',
        "tests/test_similarity.py",
    ),
    "damaged adapter files leak a SafetensorError traceback": (
        "lragent/adapters_io.py",
        "    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:",
        "    except ZeroDivisionError as exc:",
        "tests/test_memory_and_cli.py -k truncated",
    ),
    "row reused after reset keeps its old cache lengths": (
        "lragent/engine.py",
        "        self.traj[row] = Trajectory()\n",
        "        self.traj[row] = Trajectory(lengths=dict(self.traj[row].lengths))\n",
        "tests/test_row_reuse.py",
    ),
    "memory plan forgets the scratch slots": (
        "lragent/static_cache.py",
        "        kv = 2 * self.n_layers * (self.kv_slots + 1) * self.n_kv_heads * self.head_dim",
        "        kv = 2 * self.n_layers * self.kv_slots * self.n_kv_heads * self.head_dim",
        "tests/test_memory_plan.py",
    ),
    "an explicit --batch is never checked against free memory": (
        "lragent/memory_plan.py",
        "        if plan.total > free:\n            fit = _largest_fitting(",
        "        if False:\n            fit = _largest_fitting(",
        "tests/test_memory_plan.py",
    ),
    "profile: the LoRA calls are not labelled": (
        "eval_suite/profile_decode.py",
        '        (MultiLoraLinear, "lora_input", "LoRA"),\n        (MultiLoraLinear, "_add_lora", "LoRA"),\n',
        "",
        "tests/test_profile_decode.py",
    ),
    "eval: the per-answer scores taken from the metrics module again (torchmetrics in every shard's start)": (
        "eval_suite/benchmarks.py",
        "from eval_suite.answer_scores import (",
        "from eval_suite.metrics import (",
        "tests/test_shard_launch.py -k summary_metrics",
    ),
    "GPU: the training attention lets SDPA pick cuDNN (a plan per new sequence length)": (
        "lragent/attention.py",
        "            with sdpa_kernel(_NO_CUDNN):\n                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)",
        "            if True:\n                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)",
        "tests/test_training_recipe.py -k no_cudnn",
    ),
    "GPU: the q/k/v launch ignores its register cap": (
        "kernels/fused_qkv_rope.py",
        '**({"maxnreg": maxnreg} if maxnreg else {}),',
        "",
        "tests/test_fused_qkv_rope.py -k register_cap_reaches",
    ),
    "provenance: the source hash over the files in the order found, not sorted": (
        "lragent/provenance.py",
        "for f in sorted(files))",
        "for f in files)",
        "tests/test_provenance.py",
    ),
    "provenance: the source hash skips the shell scripts": (
        "lragent/provenance.py",
        'if p.suffix in (".py", ".sh")',
        'if p.suffix in (".py",)',
        "tests/test_provenance.py",
    ),
    "q/k/v in one launch: the view drops the register cap": (
        "lragent/cache_views.py",
        "maxnreg=self.qkv_maxnreg,",
        "maxnreg=0,",
        "tests/test_fused_qkv_rope.py -k engine",
    ),
    "q/k/v in one launch: no register cap by default": (
        "kernels/fused_qkv_rope.py",
        "DEFAULT_MAXNREG = 80",
        "DEFAULT_MAXNREG = 0",
        "tests/test_fused_qkv_rope.py -k register_cap_switch",
    ),
    "fit on a GPU: the host thread pool left as wide as the machine": (
        "lit_modules/multi_lora_module.py",
        "            if threads:\n                torch.set_num_threads(threads)",
        "            if threads:\n                pass",
        "tests/test_training_recipe.py -k host_thread",
    ),
    "GPU: bench decode measures the bandwidth once (before the timed steps only)": (
        "eval_suite/bench_decode.py",
        "        bandwidths.append(measure_copy_bandwidth(dev))",
        "        pass",
        "tests/test_decode_floor.py -k measures_the_bandwidth_twice",
    ),
    "GPU: decode kernel switched off": (
        "lragent/cache_views.py",
        "        kernel = _fused_decode() if (use_kernel and pos.is_cuda) else None",
        "        kernel = None",
        "tests/test_engine_gpu.py -k kernel_is_used",
    ),
    "GPU: prefill kernel switched off": (
        "lragent/attention.py",
        "        use_kernel\n        and not per_query",
        "        False\n        and not per_query",
        "tests/test_engine_gpu.py -k kernel_is_used",
    ),
    "GPU: capture as before issue 18 (warm-up and capture on two streams, pool handle kept after its graphs)": (
        "lragent/engine.py",
        (
            "        with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream):",
            "        self._graphs.clear()\n        self._graph_pool = None\n",
        ),
        (
            "        with torch.cuda.graph(graph, pool=self._graph_pool):",
            "        self._graphs.clear()\n",
        ),
        "tests/test_engine_gpu.py -k fresh_process",
    ),
    "a PEFT config/tensor rank mismatch reaches copy_ (both guards: the up-front rank check and the copy)": (
        "lragent/adapters_io.py",
        (
            "    if tuple(dst.shape) != tuple(src.shape):",
            """if rank_dim is not None and (t.dim() != 2 or t.shape[rank_dim] != pc["r"]):""",
        ),
        ("    if False:", "if False:"),
        "tests/test_memory_and_cli.py -k rank",
    ),
    "option variants: Finish letters not re-lettered": (
        "datamodules/option_variants.py",
        "        return f\"Finish[{m.group(1) or ''}{mapping[m.group(2)]}]\"",
        "        return m.group(0)",
        "tests/test_option_variants.py",
    ),
    "option variants: letter-talking trajectories varied": (
        "datamodules/option_variants.py",
        "        if traj.talks_letters:",
        "        if False:",
        "tests/test_option_variants.py",
    ),
    "option variants: gold taken from the first Finish": (
        "datamodules/option_variants.py",
        "gold = finishes[-1]",
        "gold = finishes[0]",
        "tests/test_option_variants.py",
    ),
    "option variants: gold always on the last letter": (
        "datamodules/option_variants.py",
        "pos = seen_per_k[k] % k",
        "pos = k - 1",
        "tests/test_option_variants.py",
    ),
    "paired difference compares with run 0 of the reference": (
        "eval_suite/paired.py",
        "        if rw == row and (ref, qid, run) in scores:\n            out[qid].append(value - scores[(ref, qid, run)])",
        "        if rw == row and (ref, qid, 0) in scores:\n            out[qid].append(value - scores[(ref, qid, 0)])",
        "tests/test_paired.py",
    ),
    "bootstrap over episodes instead of questions": (
        "eval_suite/paired.py",
        "    per_q = [sum(v) / len(v) for v in diffs.values()]",
        "    per_q = [d for v in diffs.values() for d in v]",
        "tests/test_paired.py",
    ),
    "any letter counts as a valid answer": (
        "eval_suite/paired.py",
        '    return bool(m) and ord(m.group(1).upper()) - ord("A") < n_choices',
        "    return bool(m)",
        "tests/test_paired.py",
    ),
    "study: an eval missing runs counts as done": (
        "eval_suite/study_jobs.py",
        '            if len(runs) < job.meta["runs"] or sampler != SAMPLER_VERSION:',
        "            if sampler != SAMPLER_VERSION:",
        "tests/test_study.py -k resumed",
    ),
    "study: memory budget ignored": (
        "eval_suite/study.py",
        "            if count[g] >= max_procs or used[g] + job.gb > gpu_gb:",
        "            if count[g] >= max_procs:",
        "tests/test_study.py -k memory",
    ),
    "study: dependencies ignored": (
        "eval_suite/study.py",
        '    return "ready" if all(is_done(jobs[d], root) for d in job.deps) else "waiting"',
        '    return "ready"',
        "tests/test_study.py -k resumed",
    ),
    "kernels import the evaluation suite (upward import)": (
        "kernels/fused_ops.py",
        "import torch\n",
        "import torch\n\nfrom lragent.report_io import markdown_table  # noqa: F401\n",
        "tests/test_import_graph.py",
    ),
    "kv_cache imports the decoder back (import cycle)": (
        "lragent/kv_cache.py",
        "from dataclasses import dataclass\n",
        "from dataclasses import dataclass\n\nfrom lragent.decoder import apply_rope  # noqa: F401\n",
        "tests/test_import_graph.py",
    ),
    "cache views import the decoder back (import cycle)": (
        "lragent/cache_views.py",
        "from lragent.rope import rope_store_unfused\n",
        "from lragent.rope import rope_store_unfused\nfrom lragent.decoder import DecoderEngine  # noqa: F401\n",
        "tests/test_import_graph.py",
    ),
    "the session parses a Scheme's name again": (
        "lragent/session.py",
        "        self.scheme = Scheme.parse(scheme)\n",
        "        self.scheme = Scheme.parse(str(scheme))\n",
        "tests/test_scheme_parse_once.py",
    ),
    "the eval factory hands the session the scheme's name (a second parse)": (
        "eval_suite/run_eval.py",
        "                model, scheme, tokenizer=tokenizer,",
        "                model, str(scheme), tokenizer=tokenizer,",
        "tests/test_scheme_parse_once.py tests/test_scheme_chain.py -k eval",
    ),
    "SessionPolicy carries the scheme again (a sixth file on eval's chain)": (
        "eval_suite/run_eval.py",
        "        return SessionPolicy(new_session, temperature=temperature, top_p=top_p, seed=task.seed)\n",
        "        policy = SessionPolicy(new_session, temperature=temperature, top_p=top_p, seed=task.seed)\n        policy.scheme = scheme\n        return policy\n",
        "tests/test_scheme_chain.py -k eval",
    ),
    "fidelity goes through the session again (a sixth file on fidelity's chain)": (
        "eval_suite/fidelity.py",
        "    engine = Engine(model, scheme, capacity=1024, growable=True, droidspeak_layers=droidspeak_layers,\n                    use_kernel=use_kernel)  # fmt: skip\n",
        "    from lragent.session import MultiAgentSession\n\n    engine = MultiAgentSession(model, scheme, droidspeak_layers=droidspeak_layers, use_kernel=use_kernel).engine\n",
        "tests/test_scheme_chain.py -k fidelity",
    ),
    "the session command passes the raw --scheme name down": (
        "eval_suite/session_runner.py",
        "        scheme=parsed, model=model,",
        "        scheme=scheme, model=model,",
        "tests/test_scheme_parse_once.py",
    ),
    "eval: a bound of the integer options dropped": (
        "eval_suite/run_eval.py",
        '"runs": 1, "max_steps": 1,',
        '"max_steps": 1,',
        "tests/test_eval_runner.py -k checks_before_writing",
    ),
    "a command imports another command": (
        "eval_suite/droidspeak_select.py",
        "from eval_suite.report import check_writable, write_json\n",
        "from eval_suite.report import check_writable, write_json\nfrom eval_suite.fidelity_command import fidelity  # noqa: F401\n",
        "tests/test_import_graph.py",
    ),
    "session accepts --max_new_tokens 0": (
        "eval_suite/session_runner.py",
        "    if max_new_tokens < 1:",
        "    if max_new_tokens < 0:",
        "tests/test_memory_and_cli.py -k zero-new-tokens",
    ),
    "a PEFT adapter set without a role passes the up-front check": (
        "lragent/adapters_io.py",
        "    missing = [r for r in roles if r not in found]",
        "    missing = []",
        "tests/test_memory_and_cli.py -k peft-no-reflect",
    ),
    "a PEFT config that is not a mapping is read as one": (
        "lragent/adapters_io.py",
        "    if not isinstance(pc, dict):",
        "    if False:",
        "tests/test_memory_and_cli.py -k peft-list",
    ),
    "multi-gpu: every rank trains on every batch (sampler)": (
        "datamodules/role_examples.py",
        "        mine = batches[self.rank :: self.num_replicas]",
        "        mine = list(batches)",
        "tests/test_multi_gpu.py -k rank_batches",
    ),
    "multi-gpu: every rank trains on every batch (two processes)": (
        "datamodules/role_examples.py",
        "        mine = batches[self.rank :: self.num_replicas]",
        "        mine = list(batches)",
        "tests/test_multi_gpu.py -k two_cpu",
    ),
    "multi-gpu: validation leftovers dropped, not filled": (
        "datamodules/role_examples.py",
        "            fill=not shuffle,",
        "            fill=False,",
        "tests/test_multi_gpu.py -k two_cpu",
    ),
    "multi-gpu: rank 1 skips its last validation batch": (
        "datamodules/role_examples.py",
        "        yield from mine[:per_rank]",
        "        yield from mine[: per_rank - int(self.rank == 1 and self.fill)]",
        "tests/test_multi_gpu.py -k validation_shards",
    ),
    "multi-gpu: a filler example is scored": (
        "datamodules/role_examples.py",
        "        return replace(e, context_len=len(e.input_ids), segments=(), source=FILLER_SOURCE)",
        "        return replace(e, source=FILLER_SOURCE)",
        "tests/test_multi_gpu.py -k filler",
    ),
    "multi-gpu: Lightning's DistributedSampler injection let through": (
        "datamodules/role_examples.py",
        '        if world > 1 and getattr(connector, "use_distributed_sampler", False):',
        "        if False:",
        "tests/test_multi_gpu.py -k distributed_sampler",
    ),
    "multi-gpu: FSDP resume drops the optimizer state": (
        "lit_modules/strategies.py",
        "            optimizer.load_state_dict(state)\n",
        "",
        "tests/test_multi_gpu.py -k two_cpu",
    ),
    "multi-gpu: FSDP wraps the adapters' modules as frozen units": (
        "lit_modules/strategies.py",
        "not any(p.requires_grad or id(p) in self.tied for p in own)",
        "not any(id(p) in self.tied for p in own)",
        "tests/test_multi_gpu.py -k wraps_frozen",
    ),
    "FitSpeed: the device synced at every micro-batch again (DDP ranks then wait for the slowest at each)": (
        "eval_suite/bench_train.py",
        '        return self.device.type == "cuda" and not self.sync_steps',
        "        return False",
        "tests/test_bench_train.py -k without_stalling",
    ),
    "FitSpeed: the lengths read from the device tensor, not the host copy": (
        "eval_suite/bench_train.py",
        '        "lengths": list(host["lengths"]) if "lengths" in host else batch["lengths"].tolist(),',
        '        "lengths": batch["lengths"].tolist(),',
        "tests/test_bench_train.py -k host_copy",
    ),
    "FitSpeed: the phases cut at the wrong hook (backward's end taken as its start)": (
        "eval_suite/bench_train.py",
        '        self._mark("backward")',
        '        self._mark("forward")',
        "tests/test_bench_train.py -k hooks",
    ),
    "GPU: FitSpeed: sync_debug counts nothing": (
        "eval_suite/bench_train.py",
        '            torch.cuda.set_sync_debug_mode("warn")',
        "            pass",
        "tests/test_training_recipe.py -k counts_the_host_syncs",
    ),
    "optimizer: the fused AdamW's clipping left to Lightning (which refuses it under bf16-mixed)": (
        "lit_modules/multi_lora_module.py",
        "        if fused and gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:",
        "        if False:",
        "tests/test_training_recipe.py -k clips_the_gradients",
    ),
    "optimizer: the fused AdamW's gradients not clipped": (
        "lit_modules/multi_lora_module.py",
        "            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)",
        "            pass",
        "tests/test_training_recipe.py -k clips_the_gradients",
    ),
    "optimizer: fused with a gradient scaler too": (
        "lit_modules/multi_lora_module.py",
        '    return bool(params) and all(p.is_cuda for p in params) and getattr(precision_plugin, "scaler", None) is None',
        "    return bool(params) and all(p.is_cuda for p in params)",
        "tests/test_training_recipe.py -k without_a_gradient_scaler",
    ),
    "training RoPE: the keys taken from the wrong heads of the joint call": (
        "lragent/rope.py",
        "        view.store(layer, qk[:, n_q:], v.transpose(1, 2), v_lr)",
        "        view.store(layer, qk[:, n_q - 1 : -1], v.transpose(1, 2), v_lr)",
        "tests/test_rope_training.py -k bit_for_bit",
    ),
    "training RoPE: the joint call taken in inference too": (
        "lragent/rope.py",
        "    if torch.is_grad_enabled() and q.shape[:2] == k.shape[:2]",
        "    if q.shape[:2] == k.shape[:2]",
        "tests/test_rope_training.py -k fewer_ops",
    ),
    "training RoPE: the joint call never taken": (
        "lragent/rope.py",
        "    if torch.is_grad_enabled() and q.shape[:2] == k.shape[:2]",
        "    if False and q.shape[:2] == k.shape[:2]",
        "tests/test_rope_training.py -k fewer_ops",
    ),
    "training norm: eps dropped from the fused formula": (
        "lragent/train_norm.py",
        (
            "        return F.rms_norm(h, h.shape[-1:], weight, eps)",
            "    return weight * F.rms_norm(h.float(), h.shape[-1:], None, eps).to(h.dtype)",
        ),
        (
            "        return F.rms_norm(h, h.shape[-1:], weight, 0.0)",
            "    return weight * F.rms_norm(h.float(), h.shape[-1:], None, 0.0).to(h.dtype)",
        ),
        "tests/test_train_norm.py -k eps_counts",
    ),
    "training norm: the fused formula taken in inference too": (
        "lragent/train_norm.py",
        "    return h.is_cuda and torch.is_grad_enabled() and",
        "    return h.is_cuda and",
        "tests/test_train_norm.py -k autograd_records",
    ),
    "training norm: the fused output left in float32 (not cast back to the input's dtype)": (
        "lragent/train_norm.py",
        "    return weight * F.rms_norm(h.float(), h.shape[-1:], None, eps).to(h.dtype)",
        "    return weight * F.rms_norm(h.float(), h.shape[-1:], None, eps)",
        "tests/test_train_norm.py -k values_and_gradients",
    ),
    "GPU: training norm: transformers' module kept on CUDA (the switch off by default)": (
        "lragent/train_norm.py",
        'os.environ.get("LRAGENT_FUSED_RMS_NORM", "1") != "0"',
        'os.environ.get("LRAGENT_FUSED_RMS_NORM", "0") not in ("0", "1")',
        "tests/test_train_norm.py -k runs_the_fused_rmsnorm_kernel",
    ),
    "GPU: PDL launch without the wait in the decode attention (its programs read q and the cache mid-predecessor)": (
        "kernels/flash_lora_decode.py",
        "        if PDL:  # kernels/pdl.py: every program waits",
        "        if False:  # kernels/pdl.py: every program waits",
        "tests/test_pdl.py",
    ),
    "GPU: PDL wait after the norm GEMV's statistic pass (reads x before the previous kernel wrote it)": (
        "kernels/fused_gemv.py",
        (
            "        if PDL:  # kernels/pdl.py: the previous kernel's output (x, the residual) is visible past this point\n            tl.extra.cuda.gdc_wait()\n        # the residual sum h is written once, by the first program of the first split\n        inv = _rms_inverse(X, RES, H_OUT, rows, r_ok, n_in, eps, pid + tl.program_id(1), HAS_RES, ROWS, BLOCK_K)",
        ),
        (
            "        inv = _rms_inverse(X, RES, H_OUT, rows, r_ok, n_in, eps, pid + tl.program_id(1), HAS_RES, ROWS, BLOCK_K)\n        if PDL:\n            tl.extra.cuda.gdc_wait()",
        ),
        "tests/test_pdl.py",
    ),
    "GPU: PDL launch without the wait in the q/k/v launch with RoPE": (
        "kernels/fused_qkv_rope.py",
        "        if PDL:  # kernels/pdl.py: the previous kernel's output (x, the positions, cos/sin) is visible past this point",
        "        if False:",
        "tests/test_pdl.py",
    ),
    "GPU: optimizer: not fused on CUDA": (
        "lit_modules/multi_lora_module.py",
        "        optimizer = torch.optim.AdamW(groups, betas=cfg.betas, eps=cfg.eps, fused=True if fused else None)",
        "        optimizer = torch.optim.AdamW(groups, betas=cfg.betas, eps=cfg.eps)",
        "tests/test_training_recipe.py -k takes_the_fused_adamw",
    ),
    "FitSpeed: a stopped fit leaves the sync debug mode on": (
        "eval_suite/bench_train.py",
        "        if self._caught is not None:\n            self._stop_sync_debug()\n",
        "        if self._caught is not None:\n            pass\n",
        "tests/test_bench_train.py -k leaves_no_sync",
    ),
    "multi-gpu: FitSpeed ranks write one file": (
        "eval_suite/bench_train.py",
        'write_json(out.with_name(f"{out.stem}.rank{rank}{out.suffix}"), {**result, "rank": rank})',
        'write_json(out, {**result, "rank": rank})',
        "tests/test_multi_gpu.py -k two_cpu",
    ),
    "multi-gpu: FSDP clips nothing": (
        "lit_modules/strategies.py",
        "        Precision.clip_grad_by_norm(self, optimizer, clip_val)",
        "        return None",
        "tests/test_multi_gpu.py -k two_cpu",
    ),
    "multi-gpu: ExportAdapters under FSDP without the gather (CPU cannot show it: the adapters are replicated)": (
        "lit_modules/export.py",
        "        if not isinstance(trainer.strategy, FSDPStrategy):",
        "        if True:",
        "tests/test_multi_gpu.py -k two_cpu",
    ),
    "fused LoRA: the role-masked A columns read one column off (last V column + A minus its last row)": (
        "lragent/decoder.py",
        "masked = role_masked(y[..., sum(group.sizes[:n]) :], mask(), rank)",
        "masked = role_masked(y[..., sum(group.sizes[:n]) - 1 : -1], mask(), rank)",
        "tests/test_decode_fusion.py -k 'module_path or on_and_off'",
    ),
    "fused LoRA: appended A rows addressed one row low (a_offset + 1)": (
        "lragent/fused_weights.py",
        "        return sum(self.sizes[: self.n_base + j])",
        "        return sum(self.sizes[: self.n_base + j]) + 1",
        "tests/test_decode_fusion.py -k 'layout or changed'",
    ),
    "fused LoRA: V_lr cached from q_proj's X·A columns": (
        "lragent/decoder.py",
        "            v_lr = lrs[2] if low_rank else None",
        "            v_lr = lrs[0] if low_rank else None",
        "tests/test_decode_fusion.py -k 'module_path or on_and_off'",
    ),
    "fused LoRA: every row gets the next role's B (role mask rolled)": (
        "lragent/multi_lora.py",
        "    return (role_ids[:, None] == torch.arange(n_roles, device=role_ids.device)).to(dtype)",
        "    return (role_ids[:, None] == torch.arange(n_roles, device=role_ids.device).roll(1)).to(dtype)",
        "tests/test_decode_fusion.py -k 'module_path or on_and_off or role_mask'",
    ),
    "fused LoRA: B term computed out of place and dropped": (
        "lragent/multi_lora.py",
        "        b2.addmm_(lr2, w, alpha=self.scaling)",
        "        torch.addmm(b2, lr2, w, alpha=self.scaling)",
        "tests/test_decode_fusion.py -k 'module_path or on_and_off'",
    ),
    "fused LoRA: A rows never refreshed after the adapters change": (
        "lragent/fused_weights.py",
        "            if self._a_keys[j] != key:",
        "            if self._a_keys[j] is None and False:",
        "tests/test_decode_fusion.py -k changed",
    ),
    "fused LoRA: cached B matrix never refreshed after a B changes": (
        "lragent/multi_lora.py",
        '        elif versions != self.__dict__.get("_cb_versions"):\n            cache.copy_(self.cat_b())',
        "        elif False:\n            cache.copy_(self.cat_b())",
        "tests/test_decode_fusion.py -k changed",
    ),
    "fused LoRA: rope kernel adds role 0's B to every row's queries": (
        "kernels/fused_ops.py",
        "                bp = QB + role * stride_qbr",
        "                bp = QB + 0 * role * stride_qbr",
        "tests/test_fused_ops.py -k interpreter",
    ),
    "fused LoRA: rope kernel reads the next head's B rows": (
        "kernels/fused_ops.py",
        "(h * 2 * HALF + d)[:, None] * stride_qbo",
        "((h + 1) % n_q_heads * 2 * HALF + d)[:, None] * stride_qbo",
        "tests/test_fused_ops.py -k interpreter",
    ),
    "fused LoRA: rope fallback adds the next role's B to the queries": (
        "kernels/fused_ops.py",
        "q_b[q_role].float()",
        "q_b[(q_role + 1) % q_b.shape[0]].float()",
        "tests/test_decode_fusion.py -k 'module_path or on_and_off'",
    ),
    "fused LoRA: q's B applied twice (in the rope launch and by the masked GEMM)": (
        "lragent/decoder.py",
        "no_b = (0,) * fold_q + (2,) * low_rank",
        "no_b = (2,) * low_rank",
        "tests/test_decode_fusion.py -k 'module_path or on_and_off'",
    ),
    "answer_text: the chosen option text maps to the wrong letter": (
        "lragent/agents/loop.py",
        'argument = yield from pick("action", answer_scored, answer_score, choose_answers)',
        'argument = yield from pick("action", answer_scored, answer_score, choose_answers[1:] + choose_answers[:1])',
        "tests/test_answer_text.py",
    ),
    "answer_text: the batched executor ignores Choose.score": (
        "eval_suite/batched_executor.py",
        "best = best_option(scores, [len(o) for o in options], request.score)",
        "best = best_option(scores, [len(o) for o in options])",
        "tests/test_answer_text.py -k sequential_equals_batched",
    ),
    "answer_text: the sequential policy ignores score": (
        "lragent/agents/policies.py",
        "best = best_option(scores, lengths, score)",
        "best = best_option(scores, lengths)",
        "tests/test_answer_text.py -k disagree",
    ),
    "answer_text: the session gets the option text, not the letter": (
        "lragent/agents/policies.py",
        "            self.session.append_text(appends[best])",
        "            self.session.append(token_lists[best])",
        "tests/test_answer_text.py -k disagree",
    ),
    "answer_text: mean divides by the wrong length": (
        "lragent/agents/requests.py",
        "ranked = [s / n for s, n in zip(sums, lengths, strict=True)]",
        "ranked = [s / max(lengths) for s, n in zip(sums, lengths, strict=True)]",
        "tests/test_answer_text.py",
    ),
    "answer_text: rows named like letter-constrained rows": (
        "eval_suite/benchmarks.py",
        "return f\"{scheme_or_row}+{','.join(cons)}\"",
        'return f"{scheme_or_row}+constrained"',
        "tests/test_answer_text.py -k rows",
    ),
    "answer_text: protocol lacks the normalisation": (
        "eval_suite/run_eval.py",
        '        protocol["answer_score"] = text_score',
        "        pass",
        "tests/test_answer_text.py -k protocol",
    ),
    "answer_text: HotpotQA refused only after the model loads": (
        "eval_suite/run_eval.py",
        "    bench.check_constraints(cons)  # answer_text on HotpotQA: refused here, before anything loads",
        "",
        "tests/test_memory_and_cli.py -k answer-text-hotpotqa",
    ),
    "GEMV launch table: the wide test inverted (gate/up takes the narrow launch, q/k/v the wide one)": (
        "kernels/fused_gemv.py",
        "    return sms > 0 and -(-n_out // NORM_CONFIG.block_n) >= WIDE_PROGRAMS_PER_SM * sms",
        "    return sms > 0 and -(-n_out // NORM_CONFIG.block_n) < WIDE_PROGRAMS_PER_SM * sms",
        "tests/test_fused_gemv.py",
    ),
    "GEMV launch table: the norm GEMV's call never passes its device (the table never reached)": (
        "kernels/fused_gemv.py",
        "    config = config or default_config(rows, True, n_out, *_device_facts(xc))",
        "    config = config or default_config(rows, True, n_out)",
        "tests/test_fused_gemv.py",
    ),
    "GEMV launch table: LRAGENT_GEMV_TABLE=0 ignored": (
        "kernels/fused_gemv.py",
        "    return device_launches(device_name) if device_name and gemv_table_setting() else None",
        "    return device_launches(device_name) if device_name else None",
        "tests/test_fused_gemv.py",
    ),
    "GEMV launch table: the plain and SiLU·mul GEMVs take the norm launch": (
        "kernels/fused_gemv.py",
        "        return launches.plain",
        "        return launches.norm",
        "tests/test_fused_gemv.py",
    ),
    "GEMV launch table: bench decode's gemv_table switch not an engine switch (taken as an attention knob)": (
        "eval_suite/bench_decode.py",
        '    "gemv_table": ("LRAGENT_GEMV_TABLE", "kernels.fused_gemv:gemv_table_switch", "gemv_table"),\n',
        "",
        "tests/test_decode_floor.py",
    ),
    "GEMV wide: the decoder fuses gate/up where the GPU's table leaves it to cuBLAS": (
        "lragent/decoder.py",
        "            if _norm_gemv_ok(view, gu, o) and not gu.lora and _wide_norm_fused(o, gu.weight.shape[0]):",
        "            if _norm_gemv_ok(view, gu, o) and not gu.lora:",
        "tests/test_fused_gemv.py -k interpreter",
    ),
    "GEMV wide: the H200's gate/up fused again (its entry's wide_unfused lost)": (
        "kernels/fused_gemv.py",
        "        wide_unfused=True,",
        "        wide_unfused=False,",
        "tests/test_fused_gemv.py -k wide",
    ),
    "GEMV wide: LRAGENT_GEMV_WIDE=0 not forced (only 1 is)": (
        "kernels/fused_gemv.py",
        "    if forced >= 0:",
        "    if forced > 0:",
        "tests/test_fused_gemv.py -k wide",
    ),
    "GEMV wide: bench decode's gemv_wide switch not an engine switch (taken as an attention knob)": (
        "eval_suite/bench_decode.py",
        '    "gemv_wide": ("LRAGENT_GEMV_WIDE", "kernels.fused_gemv:gemv_wide_setting", "gemv_wide"),\n',
        "",
        "tests/test_decode_floor.py",
    ),
    "first_argmax: the winning chunk's offset taken as chunk × chunk count": (
        "lragent/sampling.py",
        "    return (best * width + within.gather(1, best))[:, 0]",
        "    return (best * chunks + within.gather(1, best))[:, 0]",
        "tests/test_sampling_properties.py -k first_argmax",
    ),
    "first_argmax: 64 chunks whether or not they divide the vocabulary": (
        "lragent/sampling.py",
        "    while chunks > 1 and v % chunks:\n        chunks //= 2\n",
        "",
        "tests/test_sampling_properties.py -k first_argmax",
    ),
    "first_argmax: NaN dropped before the chunk maxima": (
        "lragent/sampling.py",
        "    values, within = x.reshape(b, chunks, width).max(-1)",
        '    values, within = torch.nan_to_num(x, nan=float("-inf")).reshape(b, chunks, width).max(-1)',
        "tests/test_sampling_properties.py -k first_argmax",
    ),
    "GEMV launch table: a GPU model matched as a substring (a GH200 takes the H200's launches)": (
        "kernels/fused_gemv.py",
        "    return next((launches for key, launches in DEVICE_LAUNCHES.items() if key in words), None)",
        "    return next((launches for key, launches in DEVICE_LAUNCHES.items() if key in device_name), None)",
        "tests/test_fused_gemv.py -k gpu_model",
    ),
    "GEMV split K: the counter never set back to zero (the next launch merges nothing)": (
        "kernels/fused_gemv.py",
        "                tl.store(CNT + tl.program_id(0), 0)\n",
        "",
        "tests/test_fused_gemv.py -k interpreter",
    ),
    "GEMV split K: every split takes all of K": (
        "kernels/fused_gemv.py",
        "        return lo, tl.minimum(n_in, lo + per)",
        "        return lo * 0, n_in",
        "tests/test_fused_gemv.py -k interpreter",
    ),
    "GEMV split K: the first split's partial added twice": (
        "kernels/fused_gemv.py",
        "                for s in tl.static_range(1, SPLIT_K):",
        "                for s in tl.static_range(0, SPLIT_K):",
        "tests/test_fused_gemv.py -k interpreter",
    ),
    "GPU: GEMV split K: the first program to finish merges (before the others stored)": (
        # the interpreter runs programs one after another, so its last merger still sees every partial: not caught
        # there (seen); the programs race on a GPU
        "kernels/fused_gemv.py",
        "            if done == SPLIT_K - 1:\n                tl.store(CNT + tl.program_id(0), 0)",
        "            if done == 0:\n                tl.store(CNT + tl.program_id(0), 0)",
        "tests/test_fused_gemv.py -k cuda",
    ),
    "plant_bugs: SIGINT left as inherited (a run started from a background job is never interrupted)": (
        "scripts/plant_bugs.py",
        "    signal.signal(signal.SIGINT, signal.default_int_handler)\n",
        "",
        "tests/test_plant_bugs.py",
    ),
    # question splits (tests/test_splits.py)
    "splits: a pool of several splits read test first (dev,test loads test before dev)": (
        "eval_suite/benchmarks.py",
        "        for split in self.parse_splits(splits):\n",
        "        for split in reversed(self.parse_splits(splits)):\n",
        "tests/test_splits.py -k 'each_split_holds or pools_its_splits'",
    ),
    "splits: the extra split read from the test files (extra questions the same as test ones)": (
        "eval_suite/benchmarks.py",
        'return data_dir / "benchmarks" / f"{self.file_stem(level)}.{split}.jsonl"',
        "return data_dir / \"benchmarks\" / f\"{self.file_stem(level)}.{split.replace('extra', 'test')}.jsonl\"",
        "tests/test_splits.py -k each_split_holds",
    ),
    "splits: a HotpotQA question parsed without its split (every question called dev)": (
        "eval_suite/benchmarks.py",
        'format_question(row["question"]), str(row["answer"]), split=split)',
        'format_question(row["question"]), str(row["answer"]))',
        "tests/test_splits.py -k 'each_split_holds or names_each_records_split'",
    ),
    "splits: --split kept in the order given (test,dev a pool of test first)": (
        "eval_suite/benchmarks.py",
        "    return tuple(s for s in SPLITS if s in items)",
        "    return tuple(dict.fromkeys(items))",
        "tests/test_splits.py -k canonical_order",
    ),
    "splits: an empty --split taken (a pool of no split, no error)": (
        "eval_suite/benchmarks.py",
        "    if bad or not items:",
        "    if bad:",
        "tests/test_splits.py -k 'bad_split'",
    ),
    "splits: --split extra on HotpotQA not refused (a missing file instead of the allowed splits)": (
        "eval_suite/benchmarks.py",
        "missing = [s for s in splits if s not in self.splits]",
        "missing = []",
        "tests/test_splits.py -k 'hotpotqa_has_no_extra or bad_split'",
    ),
    "splits: the HotpotQA corpus in level order (easy, medium, hard: not the index of runs before the splits)": (
        "eval_suite/benchmarks.py",
        "for f in sorted(HOTPOTQA.level_file(lv, data_dir, s) for lv in HOTPOTQA.levels)",
        "for f in [HOTPOTQA.level_file(lv, data_dir, s) for lv in HOTPOTQA.levels]",
        "tests/test_splits.py -k dev_corpus",
    ),
    "splits: the HotpotQA corpus of dev whatever the pool (a test question's paragraphs missing)": (
        "eval_suite/benchmarks.py",
        "f for s in parse_splits(splits) for f in sorted(",
        "f for s in DEFAULT_SPLITS for f in sorted(",
        "tests/test_splits.py -k 'pool_with_test or own_paragraphs'",
    ),
    "splits: the ScienceQA corpus's overlap check against dev only, whatever the pool": (
        "eval_suite/benchmarks.py",
        "SCIENCEQA.load_questions(data_dir=data_dir, splits=splits)]",
        "SCIENCEQA.load_questions(data_dir=data_dir)]",
        "tests/test_splits.py -k scienceqa_corpus",
    ),
    "splits: an eval record names dev whatever its question's split": (
        "eval_suite/run_eval.py",
        '"split": q.split,',
        '"split": "dev",',
        "tests/test_splits.py -k 'names_each_records_split or episode_records'",
    ),
    "splits: run_config.json without the eval's split": (
        "eval_suite/run_eval.py",
        '"levels": plan.levels, "split": list(plan.splits),',
        '"levels": plan.levels,',
        "tests/test_splits.py -k names_each_records_split",
    ),
    "splits: a resume into a folder of another split not refused (split not an identity field)": (
        "eval_suite/run_eval.py",
        '"seed", "agent", "droidspeak_layers", "sampler", "split",',
        '"seed", "agent", "droidspeak_layers", "sampler",',
        "tests/test_splits.py -k 'refuses_to_resume or resumes_as_dev'",
    ),
    "splits: a run_config.json from before the splits refuses to resume as dev": (
        "eval_suite/run_eval.py",
        '    "split": ["dev"],\n',
        "",
        "tests/test_splits.py -k resumes_as_dev",
    ),
    "splits: run_episodes' default toolbox over dev whatever its questions' splits": (
        "eval_suite/run_eval.py",
        "pool = [sp for sp in SPLITS if any(q.split == sp for q in questions)]",
        'pool = ["dev"]',
        "tests/test_splits.py -k own_paragraphs",
    ),
    "splits: an eval's search corpus of dev whatever --split": (
        "eval_suite/run_eval.py",
        "bench.toolbox_factory(plan.corpus_files, splits=plan.splits)",
        "bench.toolbox_factory(plan.corpus_files)",
        "tests/test_splits.py -k names_each_records_split",
    ),
    "splits: zero-shot loads the model before checking --split": (
        "eval_suite/zero_shot.py",
        "    splits = bench.parse_splits(split)\n",
        "    load_model(model, dtype=torch_dtype, device=dev)\n    splits = bench.parse_splits(split)\n",
        "tests/test_splits.py -k 'refuses_a_bad_split and zero'",
    ),
    "splits: a zero-shot record names the pool's first split, not its question's": (
        "eval_suite/zero_shot.py",
        'rec["split"] = split_of[qid]',
        'rec["split"] = splits[0]',
        "tests/test_splits.py -k zero_shot_records",
    ),
    "splits: the zero-shot summary without its split": (
        "eval_suite/zero_shot.py",
        '"model": model, "split": list(splits),',
        '"model": model,',
        "tests/test_splits.py -k zero_shot_records",
    ),
    "splits: a session reads the dev question whatever --split": (
        "eval_suite/session_runner.py",
        'path = HOTPOTQA.level_file("easy", DATA_DIR, splits[0])',
        'path = HOTPOTQA.level_file("easy", DATA_DIR)',
        "tests/test_splits.py -k session_result",
    ),
    "splits: a session result names dev whatever --split": (
        "eval_suite/session_runner.py",
        '"split": split,',
        '"split": "dev",',
        "tests/test_splits.py -k session_result",
    ),
    "splits: a session's --split not checked (a missing file's error, not the allowed splits)": (
        "eval_suite/session_runner.py",
        "splits = HOTPOTQA.parse_splits(split)",
        'splits = tuple(split.split(","))',
        "tests/test_splits.py -k 'refuses_a_bad_split and session'",
    ),
    "serve: the whole prompt re-tokenised (the trajectory's own tokens not kept for its whole pieces)": (
        "lragent/serving/trajectories.py",
        "    j = bisect.bisect_right(chars, common) - 1  # the last piece boundary inside the common text",
        "    j = 0",
        "tests/test_serve_core.py",
    ),
    "serve: the tokens shared inside the piece where prompt and trajectory part not counted": (
        "lragent/serving/trajectories.py",
        "    shared = k + common_token_prefix(rest, ids[k:])",
        "    shared = k",
        "tests/test_serve_core.py",
    ),
    "serve: the most recently used trajectory evicted instead of the least": (
        "lragent/serving/trajectories.py",
        "        return min(idle, key=self._used.__getitem__) if idle else None",
        "        return max(idle, key=self._used.__getitem__) if idle else None",
        "tests/test_serve_core.py",
    ),
    "serve: the trajectory chosen by shared text, not by what the role's caches hold under the scheme": (
        "lragent/serving/scheduler.py",
        "            return min(shared, eng.scheme.cached_len(eng.traj[row], role))",
        "            return shared",
        "tests/test_serve_core.py",
    ),
    "serve: a fork copies no V_lr": (
        "lragent/serving/rows.py",
        "                    pool.v_lr[layer][d, :upto].copy_(pool.v_lr[layer][s, :upto])  # (upto, r)",
        "                    pass",
        "tests/test_serve_core.py",
    ),
    "serve: a fork keeps what each role had seen past the shared part": (
        "lragent/serving/rows.py",
        "        seen={role: min(seen, n) for role, seen in source.seen.items()},",
        "        seen=dict(source.seen),",
        "tests/test_serve_core.py",
    ),
    "serve: a trajectory parted from in place not cut to the shared part": (
        "lragent/serving/scheduler.py",
        "                eng.truncate(row, match.shared)\n",
        "",
        "tests/test_serve_core.py",
    ),
    "serve: cached_tokens counts the recomputed positions as computed anew": (
        "lragent/serving/scheduler.py",
        "        cached = max(0, run.prompt_tokens - (res.prefill_tokens - res.recomputed_tokens))",
        "        cached = max(0, run.prompt_tokens - res.prefill_tokens)",
        "tests/test_serve_core.py tests/test_serve_api.py",
    ),
    "serve: a streamed request's last text (held back for a stop string) never sent": (
        "lragent/serving/scheduler.py",
        "        if req.stream and len(res.text) > len(run.sent) and res.text.startswith(run.sent):\n            self._send(req, Delta(res.text[len(run.sent) :]))\n",
        "",
        "tests/test_serve_core.py tests/test_serve_api.py",
    ),
    "serve: a cancelled request's row goes on generating": (
        "lragent/serving/scheduler.py",
        "                self.engine.d_remaining[row] = 0\n",
        "",
        "tests/test_serve_core.py tests/test_serve_reliability.py -k leaves",
    ),
    "serve: the context bound off by one (a prompt and max_tokens one past it accepted)": (
        "lragent/serving/scheduler.py",
        "        if n + req.max_tokens > limit:",
        "        if n + req.max_tokens > limit + 1:",
        "tests/test_serve_core.py",
    ),
    "serve: a decode step that failed leaves its rows in the engine": (
        "lragent/serving/scheduler.py",
        "                self.store.drop(row)\n            abandon_rows(self.engine, rows)\n",
        "                self.store.drop(row)\n",
        "tests/test_serve_core.py",
    ),
    "serve: requests join the batch only when it is empty (no continuous batching)": (
        "lragent/serving/scheduler.py",
        "        while self._waiting:\n            req = self._waiting[0]",
        "        while self._waiting and not self._running:\n            req = self._waiting[0]",
        "tests/test_serve_load.py",
    ),
    "serve: a client gone mid-stream does not cancel its request": (
        "eval_suite/serve/serving_completion.py",
        "        events.close()  # a client that went away mid-stream: its row stops generating",
        "        pass",
        "tests/test_serve_reliability.py -k leaves",
    ),
    "serve: any API key accepted": (
        "eval_suite/serve/api_server.py",
        '            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):',
        "            if False:",
        "tests/test_serve_reliability.py -k key",
    ),
    "serve: temperature's range not checked": (
        "eval_suite/serve/protocol.py",
        "        if v is not None and not 0 <= v <= 2:",
        "        if False:",
        "tests/test_serve_reliability.py -k bad_requests",
    ),
    "serve: SIGTERM drops the requests in flight": (
        "eval_suite/serve/api_server.py",
        "        else:\n            self.should_exit = True",
        "        else:\n            self.should_exit = self.force_exit = True",
        "tests/test_serve_reliability.py -k sigterm",
    ),
    "serve: chat messages without the assistant's turn opened": (
        "eval_suite/serve/serving_chat.py",
        "    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
        "    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)",
        "tests/test_serve_api.py -k chat",
    ),
    "serve: the base model's role has random B": (
        "lragent/serving/model.py",
        '    lm.init_adapters("zero")  # every B zero: the base role stays the base model',
        '    lm.init_adapters("random")',
        "tests/test_serve_api.py -k base_model",
    ),
    "eval --server: each call sends only its new text, not the trajectory": (
        "eval_suite/serve/client.py",
        '            "model": role, "prompt": self.text, "max_tokens": max_new_tokens, "temperature": self.temperature,',
        '            "model": role, "prompt": new_text or " ", "max_tokens": max_new_tokens, "temperature": self.temperature,',
        "tests/test_serve_eval.py -k hotpotqa",
    ),
    "bench serve: the percentile one rank high": (
        "eval_suite/serve/bench_serve.py",
        "    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]",
        "    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered))))]",
        "tests/test_serve_bench.py",
    ),
}


def run_one(name: str, results: dict) -> None:
    """Plants entry ``name`` in a fresh scratch copy, runs its tests there and records the outcome in ``results``."""
    path, old, new, tests = BUGS[name]
    scratch = SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(
        ROOT, scratch, ignore=shutil.ignore_patterns(".git", ".gguf*", ".whl", "data", "__pycache__", ".hypothesis")
    )
    os.symlink(f"{ROOT}/data", f"{scratch}/data")
    src = open(f"{scratch}/{path}").read()
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,))), strict=True):
        assert src.count(o) == 1, (name, src.count(o))
        src = src.replace(o, n)
    open(f"{scratch}/{path}", "w").write(src)
    r = subprocess.run(
        f"cd {scratch} && OMP_NUM_THREADS=1 timeout 1500 {sys.executable} -m pytest -q -x -p no:cacheprovider {tests}",
        shell=True,
        capture_output=True,
        text=True,
    )
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
    failed = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    results[name] = {"exit": r.returncode, "summary": tail, "failed": failed}
    print(name, "->", r.returncode, tail, failed, flush=True)


def save(results: dict) -> None:
    """Merges the entries run so far into RESULTS (through a temporary file: a kill mid-write leaves the old file)."""
    merged = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
    merged.update(results)
    with open(RESULTS + ".part", "w") as f:
        json.dump(merged, f, indent=1)
    os.replace(RESULTS + ".part", RESULTS)


def chosen(only: list[str]) -> list[str]:
    """The entries whose names hold one of ``only`` (all of them for none), in their order."""
    return [name for name in BUGS if not only or any(o in name for o in only)]


def main() -> int:
    # an interrupt stops the run even where this process started with SIGINT ignored (a background job of a
    # non-interactive shell, as `cmd &` in a script): without a handler Python would never raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    only = sys.argv[1:]
    if any(a in ("-h", "--help") for a in only):
        print(__doc__.strip())
        print("\nentries:\n  " + "\n  ".join(BUGS))
        return 0
    names, results, current = chosen(only), {}, None
    try:
        for current in names:
            run_one(current, results)
            save(results)  # after every entry: a call cut short keeps what finished
    except KeyboardInterrupt:  # a device call's `timeout -s INT`, or ^C: one line, what finished kept
        print(
            f"plant_bugs: interrupted during {current!r}: {len(results)} of {len(names)} run, kept in {RESULTS}",
            file=sys.stderr,
            flush=True,
        )
        return 130
    return 0


if __name__ == "__main__":  # importable: BUGS and chosen() for the GPU suite's record
    sys.exit(main())
