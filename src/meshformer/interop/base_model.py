"""A Hugging Face directory as a run's `load_checkpoint` (the protocol is train/base_source.py's): its config.json's
model shape, its weights under meshformer's names, and the base a PEFT adapter trained from it names. The CLI
hands BASE_MODEL_SOURCES to the trainer and to run_mode finetune; the readers load only when one is used."""

from __future__ import annotations

from pathlib import Path


class HfDirectory:
    label = "the Hugging Face model"

    def claims(self, path: Path) -> bool:
        from meshformer.interop.hf_dir import is_hf_dir

        return is_hf_dir(path)

    def model_fields(self, path: Path) -> dict:
        from meshformer.interop.hf_config import model_config_from_hf
        from meshformer.interop.hf_dir import _read_json

        return model_config_from_hf(_read_json(path / "config.json"), f"{path}/config.json")

    def weights(self, path: Path, expected: dict[str, tuple[int, ...]], field: str) -> dict:
        from meshformer.interop.convert import hf_weights_for

        return hf_weights_for(path, expected, field)

    def base_name(self, path: Path) -> str:
        from meshformer.interop.convert import hf_base_name

        return hf_base_name(path)


BASE_MODEL_SOURCES = (HfDirectory(),)
