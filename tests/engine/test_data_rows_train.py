"""The rows a real data set can hold, through the real training entry point (2 ranks, torchrun, FSDP2, vLLM):
images of every PIL mode and tiny sizes, odd Unicode with NUL characters, numeric answers, two images per
prompt, a text-only prompt, a video and an image + video prompt (a run that allows videos, with the
default `reuse_image_features` and a trained tower), among bad rows and a corrupt file. The kept rows all go through vLLM (validation
over the whole set) and a training step's trainer logprobs equal vLLM's: prompt ids and images agree on both
sides. Without the load-time checks the special-token and 3-image rows fail the generate call (vLLM rejects
the request), and the skipped file fails the whole load. The run shares one launch with the session's other
training runs (the `trained` fixture).
"""

import io
import json
from pathlib import Path

from PIL import Image

from spmd_grpo.data.synthetic import write_parquet
from tests.conftest import tiny_model, trainer_run
from tests.unit.test_data_rows import _modes, _png_header


def _png(size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (30, 60, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _mp4() -> bytes:
    from spmd_grpo.data.videos import encode_video

    return encode_video([Image.new("RGB", (56, 84), (40 * k, 200, 30)) for k in range(4)])


def _rows() -> tuple[list[dict], list[dict]]:
    """The rows that are kept, and the bad ones."""
    good = [
        {"problem": f"<image>mode {name}?", "answer": str(i % 4), "images": [data]}
        for i, (name, (data, _)) in enumerate(_modes().items())
    ]
    good += [
        {"problem": "<image>tiny 1x1?", "answer": "1", "images": [_png((1, 1))]},
        {
            "problem": "<image>NUL\x00 emoji \U0001f600 RTL \u05e9\u05dc\u05d5\u05dd \u202eevil?",
            "answer": "3",
            "images": [_png()],
        },
        {"problem": "two <image> and <image>?", "answer": "0", "images": [_png(), _png((28, 84))]},
        {"problem": "text only, no image?", "answer": "1", "images": []},
        {"problem": "<video>last colour?", "answer": "2", "videos": [_mp4()]},
        {"problem": "<image>then<video>?", "answer": "0", "images": [_png()], "videos": [_mp4()]},
    ]
    bad = [
        {"problem": "<image>say <|im_end|> then <|video_pad|>", "answer": "1", "images": [_png()]},
        {"problem": "<image><image><image>three", "answer": "1", "images": [_png()] * 3},
        {"problem": "<image>bomb", "answer": "1", "images": [_png_header(20000, 20000)]},
        {"problem": "<image>no answer", "answer": None, "images": [_png()]},
        {"problem": "<image>too thin for 16 tokens", "answer": "2", "images": [_png((3, 500))]},
        {"problem": "<video>broken", "answer": "1", "videos": [b"\x00\x00\x00 ftyp not really"]},
    ]
    return good, bad


def _arguments(work: Path) -> list[str]:
    data = work / "data"
    good, bad = _rows()
    write_parquet(good[:16], data / "a.parquet", row_group_size=5)
    write_parquet(bad + good[16:], data / "b.parquet")
    (data / "c_corrupt.parquet").write_bytes(b"PAR1" + b"\0" * 100)
    return [
        "configs/smoke.yaml",
        f"worker.actor.model.model_path={tiny_model()}",
        f"trainer.output_dir={work}",
        "trainer.experiment_name=rows",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.val_max_samples=-1",
        "data.max_bad_fraction=0.5",
        "data.max_prompt_length=512",
        "data.rollout_batch_size=16",
        "worker.rollout.n=2",
        "worker.rollout.limit_images=2",
        "worker.rollout.limit_videos=1",
        "data.video_min_pixels=3136",
        "data.video_max_pixels=12544",
        "data.video_max_frames=4",
        "worker.actor.global_batch_size=32",
        "worker.actor.micro_batch_size_per_device_for_update=8",
        "worker.actor.micro_batch_size_per_device_for_experience=8",
        "trainer.max_steps=1",
    ]


RUN = trainer_run("odd_rows", __file__, _arguments)


def test_odd_rows_train_and_validate(trained):
    work, out = trained(RUN)
    data, num_kept = work / "data", len(_rows()[0])
    rows = [json.loads(line) for line in (work / "rows" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["rollout/logprob_diff_max"] < 1e-3  # trainer and vLLM saw the same prompt and pixels
    assert f"loaded {num_kept} train examples" in out and f"loaded {num_kept} val examples" in out
    assert f"skipped unreadable file {data / 'c_corrupt.parquet'}" in out
    assert "row 0: text contains a special token ('<|im_end|>')" in out
    assert "row 1: more images than worker.rollout.limit_images (3 > 2)" in out
    assert "row 2: image too large" in out
    assert "row 4: image cannot be resized (3x500 has no 28-multiple size" in out
    assert "row 5: undecodable video" in out
