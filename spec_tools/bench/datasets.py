"""Benchmark prompt sets, each turned into Conversations: user turns sent one after another, each after
the model's own answer to the previous one (MT-Bench's second turn asks to rework the first answer).

- question.jsonl (FastChat's format, used by mt-bench, gsm8k, humaneval and any `--dataset-path X.jsonl`):
  one JSON object a line with `turns` (a list of strings), or a single `prompt` or `question` string
  (HumanEval's and GSM8K's own files); `question_id` / `task_id` / `id` and `category` are optional.
- ShareGPT JSON (`--dataset sharegpt` or a `.json` path): a list of `{"conversations": [{"from": "human",
  "value": ...}, ...]}`; the first human turn of each is sent.
- random: synthetic prompts of `input_len` words with fixed `output_len`-token answers (EOS ignored).
- code-edit: edit instructions over functions of Python's standard library, each with the function as
  its Predicted Output (spec_tools/bench/code_edit.py). A question.jsonl row may carry a `prediction` string
  too, sent with its first turn under `--use-prediction`.

Named datasets are looked up in $SPEC_DATASETS_DIR when set, else in `shared/datasets/` beside the
source tree and in ~/.cache/spec/datasets. They are never downloaded behind the user's back: a missing
file is an error that gives the command fetching it and where to put it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from spec_tools.bench import BenchError

RANDOM = "random"
CODE_EDIT = "code-edit"


@dataclass(frozen=True)
class Conversation:
    id: str
    category: str
    turns: tuple[str, ...]
    index: int                               # position in the loaded set: fixes each turn's sampling seed
    max_new_tokens: Optional[int] = None     # a fixed answer length (random), sent with ignore_eos
    prediction: Optional[str] = None         # Predicted Output of the first turn (--use-prediction)


@dataclass(frozen=True)
class KnownDataset:
    title: str
    file: str                     # relative to a datasets directory
    url: str
    fetch: str                    # shell command writing the file to {path}

    def command(self, path: Path) -> str:
        return self.fetch.format(url=self.url, path=path)


_CURL = "curl -L --create-dirs -o {path} {url}"
KNOWN: dict[str, KnownDataset] = {
    "mt-bench": KnownDataset("MT-Bench questions", "mt_bench/question.jsonl",
                             "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl",
                             _CURL),
    "gsm8k": KnownDataset("GSM8K problems", "gsm8k/question.jsonl",
                          "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/train.jsonl",
                          _CURL),
    "humaneval": KnownDataset("HumanEval problems", "humaneval/question.jsonl",
                              "https://github.com/openai/human-eval/raw/master/data/HumanEval.jsonl.gz",
                              "mkdir -p $(dirname {path}) && curl -L {url} | gunzip > {path}"),
    "sharegpt": KnownDataset("ShareGPT conversations", "sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json",
                             "https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered/resolve/main/"
                             "ShareGPT_V3_unfiltered_cleaned_split.json", _CURL),
}
DATASET_NAMES = (*KNOWN, RANDOM, CODE_EDIT)

# Common words: a random prompt of n words is about n tokens for most tokenizers.
_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government number "
          "night point home water room mother area money story fact month lot right study book eye job word "
          "business issue side kind head house service friend father power hour game line end member law car "
          "city community name president team minute idea kid body information back parent face others level").split()


def datasets_dirs() -> list[Path]:
    """Where named datasets are looked for, first match wins; a missing one should be put in the first."""
    env = os.environ.get("SPEC_DATASETS_DIR")
    if env:
        return [Path(env)]
    import engine

    beside_source = Path(engine.__file__).resolve().parents[1].parent / "shared" / "datasets"
    return [beside_source, Path.home() / ".cache" / "spec" / "datasets"]


def load_conversations(dataset: Optional[str] = None, path: Optional[str] = None, num_prompts: Optional[int] = None,
                       *, input_len: int = 128, output_len: int = 128, seed: int = 0) -> list[Conversation]:
    """The first `num_prompts` conversations (all when None), taken across categories in turn so that
    a small sample covers every category; `dataset` defaults to mt-bench unless `path` is given."""
    if dataset is not None and dataset not in DATASET_NAMES:
        raise BenchError(f"Unknown --dataset {dataset!r}; choose one of {', '.join(DATASET_NAMES)}, "
                         "or pass --dataset-path FILE.")
    if num_prompts is not None and num_prompts < 1:
        raise BenchError(f"--num-prompts must be at least 1, got {num_prompts}.")
    if dataset == RANDOM:
        if path is not None:
            raise BenchError("--dataset random makes its own prompts; drop --dataset-path.")
        if input_len < 1 or output_len < 1:
            raise BenchError("--random-input-len and --random-output-len must be at least 1.")
        return random_conversations(num_prompts or 32, input_len, output_len, seed)
    if dataset == CODE_EDIT:
        if path is not None:
            raise BenchError("--dataset code-edit builds its prompts from Python's standard library; drop "
                             "--dataset-path (or pass a question.jsonl with \"prediction\" fields alone).")
        from spec_tools.bench.code_edit import CATEGORY, code_edit_rows

        return [Conversation(ident, CATEGORY, (prompt,), i, prediction=prediction)
                for i, (ident, prompt, prediction) in enumerate(code_edit_rows(num_prompts or 32, seed))]
    name = dataset or ("mt-bench" if path is None else None)
    file = Path(path) if path is not None else find_dataset(name)
    if not file.is_file():
        raise BenchError(f"Dataset file {str(file)!r} does not exist; pass a question.jsonl or ShareGPT .json file.")
    category = name or file.stem
    sharegpt = name == "sharegpt" or file.suffix == ".json"
    rows = parse_sharegpt(file) if sharegpt else parse_question_jsonl(file, category)
    if not rows:
        raise BenchError(f"Dataset file {str(file)!r} holds no prompts.")
    return interleave_categories(rows, num_prompts)


def find_dataset(name: str) -> Path:
    known = KNOWN[name]
    dirs = datasets_dirs()
    for d in dirs:
        if (d / known.file).is_file():
            return d / known.file
    target = dirs[0] / known.file
    looked = ", ".join(str(d) for d in dirs)
    raise BenchError(f"{known.title} ({known.file}) are not in {looked}. Fetch them with: {known.command(target)} "
                     "(or set $SPEC_DATASETS_DIR to the folder holding them, or pass --dataset-path FILE).")


def parse_question_jsonl(file: Path, category: str) -> list[Conversation]:
    rows = []
    for line_no, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{file} line {line_no} is not valid JSON ({exc.msg}); each line must be one object "
                             "such as {\"question_id\": 1, \"category\": \"writing\", \"turns\": [\"...\"]}.") from None
        where = f"{file} line {line_no}"
        if not isinstance(row, dict):
            raise BenchError(f"{where} must be a JSON object, got {type(row).__name__}.")
        turns = row.get("turns")
        if turns is None:
            single = row.get("prompt", row.get("question"))
            turns = [single] if single is not None else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BenchError(f"{where} needs \"turns\" (a list of non-empty strings) or a \"prompt\" string.")
        ident = next((row[k] for k in ("question_id", "task_id", "id") if k in row), line_no)
        prediction = row.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise BenchError(f"{where}: \"prediction\" must be a string (the text the answer may repeat).")
        rows.append(Conversation(str(ident), str(row.get("category") or category), tuple(turns), len(rows),
                                 prediction=prediction))
    return rows


def parse_sharegpt(file: Path) -> list[Conversation]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BenchError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}); ShareGPT files are a "
                         "list of {\"conversations\": [{\"from\": \"human\", \"value\": \"...\"}]}.") from None
    if not isinstance(data, list):
        raise BenchError(f"{file} must hold a JSON list of ShareGPT conversations.")
    rows = []
    for i, item in enumerate(data):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise BenchError(f"{file} item {i} has no \"conversations\" list.")
        first = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        if isinstance(first, str) and first.strip():     # conversations opened by the model are skipped
            rows.append(Conversation(str(item.get("id", i)), "sharegpt", (first,), len(rows)))
    return rows


def random_conversations(n: int, input_len: int, output_len: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [Conversation(f"random-{i}", RANDOM, (" ".join(rng.choices(_WORDS, k=input_len)),), i, output_len)
            for i in range(n)]


def interleave_categories(rows: list[Conversation], n: Optional[int]) -> list[Conversation]:
    """Round-robin over categories (in order of first appearance): the first k rows cover all categories."""
    by_category: dict[str, list[Conversation]] = {}
    for row in rows:
        by_category.setdefault(row.category, []).append(row)
    queues = list(by_category.values())
    ordered = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
    picked = ordered[:n] if n else ordered
    return [dataclasses.replace(c, index=i) for i, c in enumerate(picked)]
