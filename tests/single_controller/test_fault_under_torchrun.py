"""fault.rollout_restarts under torchrun is refused at start: torch's elastic agent stops every
rank when one exits, so a lost rollout instance could never be replaced there."""
from __future__ import annotations

from asyncflow.single_controller.supervise import under_elastic_agent_problem


def test_the_refusal_names_the_key_torchrun_and_what_to_use_instead():
    problem = under_elastic_agent_problem(True, {"RANK": "0", "WORLD_SIZE": "3"})
    assert problem is not None
    assert "fault.rollout_restarts=true cannot run under torchrun" in problem
    assert "`asyncflow train ...` itself" in problem and "fault.rollout_restarts=false" in problem


def test_no_refusal_off_torchrun_or_with_faults_off():
    assert under_elastic_agent_problem(True, {}) is None  # asyncflow train's own launcher
    assert under_elastic_agent_problem(False, {"RANK": "1"}) is None


def test_asyncflow_train_under_torchrun_stops_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    from asyncflow import launcher

    started = []
    monkeypatch.setattr("asyncflow.launcher.run_from_env", lambda run: started.append(run) or 0)
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    code = launcher.train_main(["grpo", "placement.mode=disaggregated", "placement.actor_ranks=[0]",
                                "placement.rollout_ranks=[1,2]", "placement.reward_with=actor",
                                "fault.rollout_restarts=true", f"trainer.out_dir={tmp_path}"])
    assert code == 2 and not started
    assert "fault.rollout_restarts=true cannot run under torchrun" in capsys.readouterr().err
