"""Mutation testing of the modules whose bugs change results, with mutmut, one module at a time.

    python scripts/mutation.py                       # every module of MODULES (hours on 2 cores; use a big host)
    python scripts/mutation.py sampling paired       # the modules whose key contains one of the names
    python scripts/mutation.py similarity --exact true  # only the keys named (not similarity_report)
    python scripts/mutation.py --list                # the modules, their test files and their last scores
    python scripts/mutation.py --report              # rewrite results/mutation/README.md from the JSON files

For each module: a scratch copy of the repository (``$LRAGENT_MUTATION_SCRATCH``, default /tmp/lragent_mutation/KEY,
kept between runs so mutmut's own cache resumes an interrupted run), a ``[tool.mutmut]`` table in that copy's
``pyproject.toml`` that mutates only the module and runs only its test files, then ``mutmut run`` and ``mutmut
results --all true``: the tool's own verdict per mutant. The score is mutmut's count: killed (and timed out) over all
mutants, less the mutants marked equivalent in ``results/mutation/equivalent/KEY.json`` (``{"mutant name": "one-line
reason"}``; a mutant is equivalent when no input can tell it from the original, or when what it changes is not a
result: an error message's wording). ``results/mutation/KEY.json`` keeps
the counts, the score and every surviving mutant with its diff; ``README.md`` the table.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's lragent (its command machinery), whatever is installed
OUT = ROOT / "results" / "mutation"
SCRATCH = Path(os.environ.get("LRAGENT_MUTATION_SCRATCH", "/tmp/lragent_mutation"))
# scripts/ is no package: the tests load its files as scripts.<name> (tests/conftest.py), the names mutmut gives them
PACKAGES = ["lragent", "eval_suite", "datamodules", "lit_modules", "kernels", "scripts"]

# key -> (module file, mutant-name pattern or "" for the whole module, test files that cover it). Not selected:
# tests/test_scheme_chain.py, whose sys.settrace trail of the scheme through the library cannot see through mutmut's
# trampolines (it fails on the unmutated code there; it passes in the plain suite).
MODULES: dict[str, tuple[str, str, list[str]]] = {
    "decide": ("eval_suite/study/decide.py", "", ["tests/test_study_decide.py"]),
    "sampling": (
        "lragent/sampling.py",
        "",
        ["tests/test_sampling_properties.py", "tests/test_engine.py", "tests/test_row_reuse.py"],
    ),
    "paired": ("eval_suite/scoring/paired.py", "", ["tests/test_paired_properties.py", "tests/test_paired.py"]),
    "metrics": (
        "eval_suite/scoring/metrics.py",
        "",
        ["tests/test_metrics_properties.py", "tests/test_eval_metrics.py"],
    ),
    "answer_scores": (
        "eval_suite/scoring/answer_scores.py",
        "",
        ["tests/test_metrics_properties.py", "tests/test_eval_metrics.py"],
    ),
    "option_variants": (
        "datamodules/option_variants.py",
        "",
        ["tests/test_option_variants_properties.py", "tests/test_option_variants.py"],
    ),
    "tools": (
        "lragent/agents/tools.py",
        "",
        ["tests/test_tools_properties.py", "tests/test_agents_tools.py", "tests/test_agents_loop.py"],
    ),
    "policies": (
        "lragent/agents/policies.py",
        "",
        ["tests/test_policies_properties.py", "tests/test_agents_requests.py", "tests/test_agents_loop.py"],
    ),
    "loop": (
        "lragent/agents/loop.py",
        "",
        ["tests/test_loop_properties.py", "tests/test_agents_loop.py"],  # test_eval_runner: 80 s per mutant
    ),
    "batched_executor": (
        "eval_suite/evaluate/batched_executor.py",
        "",
        ["tests/test_batched_executor_properties.py"],  # test_batched_executor: 220-280 s a run on 2 cores
    ),
    "prompt_template": ("eval_suite/evaluate/prompt_template.py", "", ["tests/test_prompt_template.py"]),
    "static_cache": (
        "lragent/static_cache.py",
        "",
        ["tests/test_static_cache.py", "tests/test_engine.py", "tests/test_memory_plan.py"],
    ),
    "sharing": ("lragent/sharing.py", "", ["tests/test_sharing_properties.py"]),
    "cache_views": (
        "lragent/cache_views.py",
        "",
        ["tests/test_cache_views_properties.py", "tests/test_two_piece_attention.py"],
    ),
    "engine": (
        "lragent/engine.py",
        "",
        [
            "tests/test_engine_properties.py",
            "tests/test_engine.py",
            "tests/test_row_reuse.py",
            "tests/test_memory_plan.py",
        ],
    ),
    "eval_timing": ("eval_suite/evaluate/eval_timing.py", "", ["tests/test_eval_timing.py"]),
    "work_queue": ("eval_suite/evaluate/work_queue.py", "", ["tests/test_work_queue.py"]),
    "episode_log": (
        "eval_suite/evaluate/episode_log.py",
        "",
        ["tests/test_work_queue.py", "tests/test_stall_watchdog.py", "tests/test_splits.py"],
    ),
    "stall_watchdog": ("eval_suite/evaluate/stall_watchdog.py", "", ["tests/test_stall_watchdog.py"]),
    "study_jobs": ("eval_suite/study/jobs.py", "", ["tests/test_study.py", "tests/test_study_decide.py"]),
    "study_driver": (
        "eval_suite/study/driver.py",
        "",
        ["tests/test_study_driver_units.py", "tests/test_study.py", "tests/test_study_decide.py"],
    ),
    "training_logs": ("eval_suite/study/training_logs.py", "", ["tests/test_study.py"]),
    "training_report": ("eval_suite/study/training_report.py", "", ["tests/test_study.py"]),
    "report_io": ("lragent/report_io.py", "", ["tests/test_report_io.py"]),
    "protocol": ("eval_suite/serve/protocol.py", "", ["tests/test_protocol_branches.py"]),
    "trajectories": ("lragent/serving/trajectories.py", "", ["tests/test_serve_core.py"]),
    "text_encoder": ("lragent/serving/text_encoder.py", "", ["tests/test_text_encoder.py"]),
    "serving_metrics": (
        "lragent/serving/metrics.py",
        "",
        ["tests/test_serve_core.py", "tests/test_metrics_properties.py"],
    ),
    "converted_cache": ("lragent/converted_cache.py", "", ["tests/test_converted_cache.py"]),
    "accuracy_model": ("lragent/accuracy_model.py", "", ["tests/test_accuracy_model.py"]),
    "device_share": ("lragent/device_share.py", "", ["tests/test_device_share.py"]),
    "memory_plan": ("lragent/memory_plan.py", "", ["tests/test_memory_plan.py"]),
    "prefix_packing": (
        "datamodules/prefix_packing.py",
        "",
        ["tests/test_prefix_packing.py", "tests/test_datamodule.py"],
    ),
    "provenance": ("lragent/provenance.py", "", ["tests/test_provenance.py"]),
    "command": ("lragent/command.py", "", ["tests/test_command.py"]),
    "eval_report": ("eval_suite/evaluate/eval_report.py", "", ["tests/test_paired.py", "tests/test_shard_launch.py"]),
    "export": ("lit_modules/export.py", "", ["tests/test_export_checks.py"]),
    "adapters_io": ("lragent/adapters_io.py", "", ["tests/test_adapters_io_branches.py", "tests/test_multi_lora.py"]),
    "roles": ("lragent/roles.py", "", ["tests/test_multi_lora.py"]),
    "benchmarks": ("eval_suite/evaluate/benchmarks.py", "", ["tests/test_eval_benchmarks.py", "tests/test_splits.py"]),
    "cross_role_prefixes": (  # not test_cross_role_batches (over 4 min a run here: its absorbed-loss checks train)
        "datamodules/cross_role_prefixes.py",
        "",
        ["tests/test_cross_role_prefixes_units.py"],
    ),
    "answer_thoughts": ("datamodules/answer_thoughts.py", "", ["tests/test_answer_thoughts.py"]),
    "serving_rows": ("lragent/serving/rows.py", "", ["tests/test_serve_core.py"]),
    "scienceqa_corpus": ("eval_suite/evaluate/scienceqa_corpus.py", "", ["tests/test_eval_benchmarks.py"]),
    "prompts": (
        "lragent/agents/prompts.py",
        "",
        ["tests/test_agents_loop.py", "tests/test_eval_benchmarks.py", "tests/test_prompts.py"],
    ),
    "dir_lock": ("eval_suite/evaluate/dir_lock.py", "", ["tests/test_dir_lock.py"]),
    "constraints": ("lragent/agents/constraints.py", "", ["tests/test_agents_requests.py"]),
    "requests": (
        "lragent/agents/requests.py",
        "",
        ["tests/test_agents_requests.py", "tests/test_batched_executor_properties.py"],
    ),
    "multi_lora_module_loss": (  # the loss paths only: token loss, the λ-weighted shared term, the training step
        "lit_modules/multi_lora_module.py",
        "lit_modules.multi_lora_module.*loss*",
        ["tests/test_loss_weights.py", "tests/test_training.py", "tests/test_training_recipe.py"],
    ),
    "schemes": ("lragent/schemes.py", "", ["tests/test_sharing_properties.py", "tests/test_scheme_parse_once.py"]),
    "rope": ("lragent/rope.py", "", ["tests/test_rope_training.py"]),
    "train_norm": ("lragent/train_norm.py", "", ["tests/test_train_norm.py"]),
    "frozen_cast": ("lragent/frozen_cast.py", "", ["tests/test_frozen_cast.py"]),
    "kv_cache": (
        "lragent/kv_cache.py",
        "",
        ["tests/test_kv_cache.py", "tests/test_cache_views_properties.py", "tests/test_decoder_checks.py"],
    ),
    "loading": ("lragent/loading.py", "", ["tests/test_loading_branches.py"]),
    "serving_model": ("lragent/serving/model.py", "", ["tests/test_serving_model_checks.py"]),
    "executors": ("eval_suite/evaluate/executors.py", "", ["tests/test_batched_executor.py"]),
    "time_budget": ("lit_modules/time_budget.py", "", ["tests/test_time_budget.py"]),
    "run_status": ("lit_modules/run_status.py", "", ["tests/test_run_status.py"]),
    "host_threads": ("lragent/host_threads.py", "", ["tests/test_rank_pinning.py", "tests/test_host_threads.py"]),
    "fused_weights": ("lragent/fused_weights.py", "", ["tests/test_fused_weights.py"]),  # test_decode_fusion: 27 s
    "pdl": ("kernels/pdl.py", "", ["tests/test_pdl.py"]),
    "split_workspace": ("kernels/split_workspace.py", "", ["tests/test_split_workspace.py"]),  # not test_engine
    "progress": ("lit_modules/progress.py", "", ["tests/test_progress.py"]),
    "report": ("eval_suite/report.py", "", ["tests/test_report_branches.py"]),
    "session": ("lragent/session.py", "", ["tests/test_session.py"]),  # the two schedule files: 85 s a run
    "multi_lora": ("lragent/multi_lora.py", "", ["tests/test_multi_lora.py", "tests/test_multi_lora_layer.py"]),
    "lora_model": ("lragent/lora_model.py", "", ["tests/test_multi_lora.py", "tests/test_lora_model.py"]),
    "models": ("lragent/models.py", "", ["tests/test_models.py"]),
    "strategies": ("lit_modules/strategies.py", "", ["tests/test_fsdp_strategy_checks.py"]),
    "scheduler": ("lragent/serving/scheduler.py", "", ["tests/test_scheduler_units.py", "tests/test_serve_core.py"]),
    "decoder": (  # not test_decode_fusion (27 s) nor the interpreter checks of test_fused_qkv_rope
        "lragent/decoder.py",
        "",
        ["tests/test_decoder_properties.py", "tests/test_decoder_checks.py"],
    ),
    "role_examples": (
        "datamodules/role_examples.py",
        "",
        ["tests/test_datamodule.py", "tests/test_role_examples_batches.py", "tests/test_role_examples_units.py"],
    ),
    "zero_shot": ("eval_suite/evaluate/zero_shot.py", "", ["tests/test_zero_shot_probe.py"]),  # test_zero_shot: 22 s
    "shard_launch": (
        "eval_suite/evaluate/shard_launch.py",
        "",
        ["tests/test_shard_launch.py", "tests/test_shard_launch_units.py"],
    ),
    "server_state": ("eval_suite/serve/server_state.py", "", ["tests/test_serve_handlers.py"]),
    "serving_completion": ("eval_suite/serve/serving_completion.py", "", ["tests/test_serve_handlers.py"]),
    "serving_chat": ("eval_suite/serve/serving_chat.py", "", ["tests/test_serve_handlers.py"]),
    "serve_events": ("eval_suite/serve/engine_client.py", "", ["tests/test_serve_handlers.py"]),
    "api_server": ("eval_suite/serve/api_server.py", "", ["tests/test_serve_handlers.py"]),
    "serve_cli": (
        "eval_suite/serve/serve_command.py",
        "",
        ["tests/test_serve_command_wiring.py", "tests/test_serve_command_branches.py"],
    ),
    "schedule_runner": ("eval_suite/evaluate/session_runner.py", "", ["tests/test_session_runner_units.py"]),
    "server_client": ("eval_suite/evaluate/server_client.py", "", ["tests/test_server_client_units.py"]),
    "prompt_pieces": ("lragent/prompt_pieces.py", "", ["tests/test_prompt_pieces_and_byte_tokenizer.py"]),
    "tiny_tokenizer": ("datamodules/tiny_tokenizer.py", "", ["tests/test_prompt_pieces_and_byte_tokenizer.py"]),
    "sigterm_check": ("lit_modules/sigterm_check.py", "", ["tests/test_sigterm_check_units.py"]),
    "speed_table": ("eval_suite/bench/speed_table.py", "", ["tests/test_speed_table.py"]),
    "model_flops": ("eval_suite/bench/model_flops.py", "", ["tests/test_model_flops_units.py"]),  # not its trace: 324 s
    "multi_gpu_report": ("eval_suite/bench/multi_gpu_report.py", "", ["tests/test_multi_gpu_report.py"]),
    "data_stats": ("eval_suite/diagnostics/data_stats.py", "", ["tests/test_data_stats_units.py"]),  # bundled: 47 s
    "study_report": ("eval_suite/study/report.py", "", ["tests/test_study.py", "tests/test_study_report_units.py"]),
    "similarity_report": (
        "eval_suite/diagnostics/similarity_report.py",
        "",
        ["tests/test_similarity.py", "tests/test_similarity_report_units.py"],
    ),
    "run_eval": (  # not the embedded-model end-to-end test nor the --devices / several-benchmark shard runs (100+ s)
        "eval_suite/evaluate/run_eval.py",
        "",
        ["tests/test_eval_runner.py", "tests/test_shard_launch.py"],
    ),
    "droidspeak_select": (
        "eval_suite/diagnostics/droidspeak_select.py",
        "",
        ["tests/test_fidelity.py", "tests/test_droidspeak_select_units.py"],
    ),
    "cli_main": ("lragent/cli_main.py", "", ["tests/test_cli_main_units.py"]),
    "lit_cli": ("lit_modules/cli.py", "", ["tests/test_lit_cli_units.py"]),
    "fidelity_command": ("eval_suite/diagnostics/fidelity_command.py", "", ["tests/test_fidelity_command_units.py"]),
    "attention": ("lragent/attention.py", "", ["tests/test_attention_units.py"]),  # test_two_piece_attention: 106 s
    "peft_check": ("eval_suite/diagnostics/peft_check.py", "", ["tests/test_peft_check.py"]),
    "fidelity": (
        "eval_suite/diagnostics/fidelity.py",
        "",
        ["tests/test_fidelity_units.py", "tests/test_fidelity.py"],
    ),
    "similarity": (
        "eval_suite/diagnostics/similarity.py",
        "",
        ["tests/test_similarity_units.py", "tests/test_similarity.py"],
    ),
    "ship_adapter_set": ("scripts/ship_adapter_set.py", "", ["tests/test_ship_adapter_set_files.py"]),
    "gpu_tests_record": ("scripts/gpu_tests_record.py", "", ["tests/test_gpu_tests_record.py"]),
    "plant_bugs": ("scripts/plant_bugs.py", "", ["tests/test_plant_bugs.py"]),
    "mutation_tool": ("scripts/mutation.py", "", ["tests/test_mutation_files.py"]),
}
# functions mutmut must leave unwrapped, by their whole def line: Lightning's save_hyperparameters() reads the
# arguments of the __init__ frame that called it, which mutmut's trampoline hides (hparams come out empty). The
# scratch copy marks them `# pragma: no mutate block`; the repository's source stays clean.
UNWRAPPED: dict[str, list[str]] = {"multi_lora_module_loss": ["    def __init__("]}  # MultiLoraModule's
# tests that cannot run under mutmut's trampolines (they fail on the unmutated code there, pass in the plain suite):
# isinstance against the runtime-checkable Policy protocol, defined in the mutated module itself
DESELECT: dict[str, list[str]] = {
    "policies": ["tests/test_agents_loop.py::test_helpers"],
    # run_eval: the tests of 10 s and more (the embedded model, the tiny model's evals, --devices shards, console
    # subprocesses): run_plan and fan_out are run in-process by the fast tests of the same files
    "run_eval": [
        f"tests/test_eval_runner.py::{name}"
        for name in (
            "test_eval_command_end_to_end_on_the_embedded_model",
            "test_a_killed_eval_keeps_its_timing_and_the_resumed_run_adds_to_it",
            "test_devices_shards_equal_one_process",
            "test_several_benchmarks_in_one_process_and_on_two_shards_equal_one_run_each",
            "test_sigterm_stops_an_eval_like_ctrl_c_with_its_records_and_time_kept",
            "test_eval_launch_ahead_is_an_option_its_records_name",
            "test_an_interrupt_between_a_records_append_and_its_count_keeps_the_logs_count",
        )
    ]
    + [
        f"tests/test_shard_launch.py::{name}"
        for name in (
            "test_a_profiled_console_eval_still_writes_its_profile",
            "test_an_eval_process_imports_the_summary_metrics_only_to_write_a_summary",
            "test_a_console_eval_exits_with_its_status",
            "test_the_console_entry_starts_without_torch",
        )
    ],
}
# mutmut's wall-clock limit per mutant is (its tests' measured seconds + 1) x timeout_multiplier (15 by default); a
# mutant stopped there is a timeout, counted as caught. Where a poll loop is mutated to spin forever that wait is long:
# the study driver's run() (tests 24 s) waited 379 s a mutant and a run stopped with 329 unchecked; run_eval's and
# similarity's poll loops (15-20 s) 4-5 minutes. Survivors ran at most 1.3x their measured time, so 3 and 5 leave
# room for a busy host.
TIMEOUT_MULTIPLIER: dict[str, float] = {"study_driver": 3.0, "run_eval": 5.0, "similarity": 5.0, "engine": 3.0}
STATUS = re.compile(r"^\s+(\S+): (.+)$")


def _copy_repo(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the repository, as a CI checkout would have them."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    ).stdout.split(b"\0")
    for name in (f.decode() for f in files if f):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _reset_unkilled(work: Path) -> None:
    """Forget mutmut's verdict on every mutant that no test killed, so the next ``mutmut run`` tests it again."""
    from mutmut.stats import status_by_exit_code  # the tool's own reading of its exit codes

    for meta in (work / "mutants").rglob("*.py.meta"):
        data = json.loads(meta.read_text())
        codes = data.get("exit_code_by_key", {})
        for k, v in codes.items():
            if status_by_exit_code[v] not in ("killed", "timeout"):  # a kill stands: tests are only ever added
                codes[k] = None
        meta.write_text(json.dumps(data))


def _config(module: str, tests: list[str], deselect: list[str] = (), timeout_multiplier: float | None = None) -> str:
    def arr(xs: list[str]) -> str:
        return "[" + ", ".join(json.dumps(x) for x in xs) + "]"

    # results/mutation: the test that the committed report is what the committed results say reads it
    also = ["cli.py", "configs", "data", "docs", "README.md", "results/mutation"]
    pytest_deselect = [a for d in deselect for a in ("--deselect", d)]
    return (
        "\n[tool.mutmut]\n"
        f"source_paths = {arr(PACKAGES)}\n"
        f"only_mutate = {arr([module])}\n"
        f"also_copy = {arr(also)}\n"
        f"pytest_add_cli_args_test_selection = {arr(tests)}\n"
        f"pytest_add_cli_args = {arr(['-p', 'no:cacheprovider', '-q', '-n', '0', *pytest_deselect])}\n"
        + (f"timeout_multiplier = {timeout_multiplier}\n" if timeout_multiplier is not None else "")
    )


def run_module(key: str, workers: int, timeout_s: int) -> dict:
    module, pattern, tests = MODULES[key]
    tests = [t for t in tests if (ROOT / t).is_file()]
    work = SCRATCH / key
    source = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    module_hash = hashlib.sha256((ROOT / module).read_bytes()).hexdigest()
    tests_hash = hashlib.sha256("".join(tests).encode() + b"".join((ROOT / t).read_bytes() for t in tests)).hexdigest()
    stamp = work / ".lragent_source"
    old = stamp.read_text().split() if stamp.exists() else []
    if old[:1] != [module_hash]:  # a new module: every mutant again
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        _copy_repo(work)
        if UNWRAPPED.get(key):
            lines = (work / module).read_text().splitlines(keepends=True)
            for prefix in UNWRAPPED[key]:
                i = next(i for i, line in enumerate(lines) if line.rstrip("\n") == prefix)
                j = next(j for j in range(i, len(lines)) if lines[j].rstrip().endswith(":"))  # the header's colon
                lines[j] = lines[j].rstrip("\n") + "  # pragma: no mutate block\n"  # where mutmut reads it
            (work / module).write_text("".join(lines))
    elif old[1:] != [tests_hash]:  # new tests: bring them in, re-test only what no test killed
        for t in tests:
            for dest in (work / t, work / "mutants" / t):
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / t, dest)
        _reset_unkilled(work)
    table = _config(module, tests, DESELECT.get(key, []), TIMEOUT_MULTIPLIER.get(key))
    (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + table)
    stamp.write_text(f"{module_hash} {tests_hash}")
    t0 = time.time()
    cmd = ["mutmut", "run", "--max-children", str(workers)] + ([pattern] if pattern else [])
    # one thread: torch's OpenMP pool does not survive mutmut's fork (a child then waits on a lock until mutmut
    # calls it a timeout, which would count as a kill)
    env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        run = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout_s, env=env)
        interrupted = run.returncode != 0
        tail = (run.stdout + run.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        interrupted, tail = True, f"stopped after {timeout_s} s (rerun to resume)"
    seconds = time.time() - t0
    listing = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=work, capture_output=True, text=True, env=env
    ).stdout
    status = {m.group(1): m.group(2).strip() for m in map(STATUS.match, listing.splitlines()) if m}
    if pattern:
        rx = re.compile(pattern.replace(".", r"\.").replace("*", ".*") + "$")
        status = {k: v for k, v in status.items() if rx.match(k)}
    eq_file = OUT / "equivalent" / f"{key}.json"
    equivalent = json.loads(eq_file.read_text()) if eq_file.exists() else {}
    counts: dict[str, int] = {}
    for v in status.values():
        counts[v] = counts.get(v, 0) + 1
    marked = {k: equivalent[k] for k in status if k in equivalent and status[k] != "killed"}
    killed = sum(1 for k, v in status.items() if v in ("killed", "timeout") and k not in marked)
    considered = sum(1 for k, v in status.items() if v not in ("skipped", "not checked") and k not in marked)
    survivors = []
    for k, v in sorted(status.items()):
        if v in ("killed", "timeout", "not checked", "skipped") or k in marked:
            continue  # an unchecked mutant is counted (``complete`` is false), not listed; a skipped one, neither
        diff = subprocess.run(["mutmut", "show", k], cwd=work, capture_output=True, text=True, env=env).stdout
        survivors.append({"mutant": k, "status": v, "diff": "\n".join(diff.splitlines()[1:])})
    result = {
        "module": module,
        "pattern": pattern or None,
        "tests": tests,
        "counts": counts,
        "equivalent": marked,
        "killed_or_timeout": killed,
        "considered": considered,
        "score": round(100 * killed / considered, 1) if considered else None,
        "survivors": survivors,
        "complete": not interrupted and "not checked" not in counts,
        "seconds": round(seconds, 1),
        "workers": workers,
        "tool": f"mutmut {importlib.metadata.version('mutmut')}",
        "commit": source,
        "host_cpus": os.cpu_count(),
        "log_tail": tail if interrupted else "",
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{key}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


_TIMING = "benchmark or profiler: times GPU work for a person to read; no evaluation or training record comes from it"
_KERNEL = (
    "Triton kernels (decorated: mutmut leaves them alone) and launchers that run only on a GPU or under the "
    "interpreter (minutes a test run): checked against their torch references on the GPU and under the interpreter"
)
LEFT_OUT: dict[str, str] = {
    **{
        f"eval_suite/bench/{name}.py": _TIMING
        for name in (
            "decode",
            "eval_throughput",
            "fused_gemv",
            "kernel",
            "profile_decode",
            "profile_prefill",
            "timed_model",
            "trace",
            "train",
        )
    },  # fmt: skip
    "eval_suite/bench/serve_match.py": "benchmark: times the server's prompt match on the host for a person to read; "
    "its reference search is what tests/test_serve_core.py compares the served match against",
    **{
        f"kernels/{name}.py": _KERNEL
        for name in (
            "consumer_rows",
            "flash_lora_attention",
            "flash_lora_decode",
            "fused_gemv",
            "fused_ops",
            "fused_qkv_rope",
        )
    },  # fmt: skip
    **{
        name: "module-level code only (mutmut mutates function bodies): no mutants"
        for name in ("lragent/paths.py", "eval_suite/study/__main__.py")
    },
    "eval_suite/serve/bench_serve.py": "benchmark: a load generator timing a server for a person to read; the server "
    "it measures (scheduler, trajectories, API) is mutation-tested module by module",
    "datamodules/records.py": "frozen dataclasses and one property, which mutmut cannot reach (it traces no call into "
    "a property: it generated mutants and checked none); n_examples is asserted in tests/test_prefix_packing.py",
    "kernels/device_guard.py": "one decorator whose wrapper mutmut cannot reach (it traces no call into a function "
    "nested in a decorator: it generated mutants and checked none); tests/test_device_guard.py checks it on the CPU",
}
"""Modules of PACKAGES left out of mutation testing, each with the reason (the report lists them)."""


def unscored_modules() -> list[tuple[str, str]]:
    """The modules of PACKAGES that no MODULES entry covers, each with its reason to be left out or ``not run yet``."""
    covered = {module for module, _, _ in MODULES.values()}
    found = sorted(
        str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py"
    )
    return [(m, LEFT_OUT.get(m, "not run yet")) for m in found if m not in covered]


UNREACHED = "could not find any test case for any mutant"
"""What mutmut prints when its stats run saw no test run any mutated function (it then checks none)."""


def write_report() -> Path:
    rows = []
    for key in MODULES:
        path = OUT / f"{key}.json"
        if not path.exists():
            rows.append(f"| `{MODULES[key][0]}` | not run yet | | | | |")
            continue
        r = json.loads(path.read_text())
        c = r["counts"]
        if not c and UNREACHED in r.get("log_tail", ""):
            rows.append(
                f"| `{r['module']}` | no mutant checked | | | | mutmut generated mutants but found no test that "
                f"reaches them (it cannot trace a call into a property or a function nested in a decorator), "
                f"{r['commit'][:7]} |"
            )
            continue
        rows.append(
            f"| `{r['module']}`{' (' + r['pattern'] + ')' if r['pattern'] else ''} | "
            + (
                f"{r['score']}% | "
                if r["complete"]
                else f"incomplete ({sum(c.values()) - c.get('not checked', 0)} of {sum(c.values())} checked) | "
            )
            + f"{r['killed_or_timeout']} of {r['considered']} | "
            f"{len(r['equivalent'])} | {len(r['survivors'])} | "
            f"{'complete' if r['complete'] else 'interrupted'}, {r['seconds']:.0f} s on {r['workers']} workers "
            f"({r['host_cpus']} CPUs), {r['commit'][:7]}; {', '.join(f'{k} {v}' for k, v in sorted(c.items()))} |"
        )
    text = (
        "# Mutation testing\n\n"
        "`python scripts/mutation.py [KEY ...]` (mutmut, one module at a time, only the module's test files; "
        "`--list` names them). Score: mutmut's killed (+ timeout) over its mutants, less those marked equivalent in "
        "`equivalent/KEY.json` with a one-line reason each (a timeout, a mutant that made the tests hang, counts as "
        "caught; runs set OMP_NUM_THREADS=1, since torch's thread pool hangs in mutmut's forked children and would "
        "turn survivors into timeouts). Survivors with their diffs are in `KEY.json`; the last column gives mutmut's "
        "raw counts (equivalents included) and the commit checked out when the run started (new tests may have been "
        "uncommitted then: they are committed with the results). mutmut leaves decorated functions alone, so their "
        "bodies are in no score (in `lragent/engine.py`: `_run_op`, `_run_lr_forward` and `_decode_step`, under "
        "`@_own_workspaces`); their tests still run against every other mutant.\n\n"
        "| module | score | killed | equivalent | survivors | run |\n|---|---:|---:|---:|---:|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    unscored = unscored_modules()
    if unscored:
        text += (
            f"\n## Not scored ({len(unscored)} modules)\n\n| module | why |\n|---|---|\n"
            + "\n".join(f"| `{m}` | {why} |" for m, why in unscored)
            + "\n"
        )
    OUT.mkdir(parents=True, exist_ok=True)  # a fresh checkout's first report
    (OUT / "README.md").write_text(text)
    return OUT / "README.md"


def mutation(
    names: list[str] | None = None,
    workers: int = os.cpu_count() or 1,
    timeout: int = 3600,
    list: bool = False,  # noqa: A002  (the option's name)
    report: bool = False,
    exact: bool = False,
) -> int:
    """Mutation testing of the modules whose bugs change results, one module at a time.

    Args:
        names: keys (or parts of keys) of MODULES; none: all.
        workers: mutmut --max-children.
        timeout: seconds per module before stopping (resumable).
        list: the modules and their test files.
        report: only rewrite results/mutation/README.md.
        exact: the names are whole keys (``similarity`` without ``similarity_report``).

    Returns:
        the exit status.
    """
    keys = [k for k in MODULES if not names or any(n == k if exact else n in k for n in names)]
    if not keys:
        raise ValueError(f"no module matches {names}; allowed: {', '.join(MODULES)}")
    if list:
        for k in keys:
            print(f"{k:24s} {MODULES[k][0]:36s} {' '.join(MODULES[k][2])}")
        return 0
    failed = False
    if not report:
        if shutil.which("mutmut") is None:
            raise FileNotFoundError("mutmut is not installed: pip install mutmut==3.8.1")
        for k in keys:
            r = run_module(k, workers, timeout)
            if "failed to collect stats" in r["log_tail"]:
                print(
                    f"error: {k}: a selected test fails on the unmutated code (mutmut cannot start): see the end of "
                    f"results/mutation/{k}.json's log_tail",
                    file=sys.stderr,
                )
                failed = True
                continue
            print(f"{k}: {r['score']}% ({r['killed_or_timeout']} of {r['considered']}), {len(r['survivors'])} left")
    print(write_report())
    return 2 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python scripts/mutation.py [NAME...] [options]`` (:func:`mutation`)."""
    from lragent.command import run_command

    return run_command(mutation, argv, "scripts/mutation.py", positional=["names"])


if __name__ == "__main__":
    sys.exit(main())
