"""docs/models.md is what the connector's KV cache checks decide, regenerated whenever they change."""

from __future__ import annotations

from maru_connector.vllm import models_doc


def test_the_committed_models_table_is_fresh() -> None:
    assert models_doc.DOC_PATH.read_text() == models_doc.render(), (
        "regenerate with `python -m maru_connector.vllm.models_doc`"
    )


def test_check_mode_fails_on_a_stale_table(tmp_path, monkeypatch) -> None:
    stale = tmp_path / "models.md"
    stale.write_text(models_doc.render().replace("served", "refused", 1))
    monkeypatch.setattr(models_doc, "DOC_PATH", stale)
    assert models_doc.main(["--check"]) == 1
    stale.write_text(models_doc.render())
    assert models_doc.main(["--check"]) == 0


def test_each_row_comes_from_the_checks() -> None:
    rows = {
        line.split(" | ")[0].lstrip("| "): line for line in models_doc.render().splitlines() if line.startswith("| ")
    }
    assert rows["DeepSeek-V2/V3/R1, Kimi K2"].endswith("| served |")
    assert "stored once (TP rank 0)" in rows["DeepSeek-V2/V3/R1, Kimi K2"]
    hybrid = rows["Gemma 3, gpt-oss, with vLLM's hybrid KV cache manager on (vLLM's default)"]
    assert hybrid.endswith("| served |") and "only their window" in hybrid
    assert "mamba_cache_mode 'align'" in rows["Mamba, Mamba2, Falcon-Mamba"]
