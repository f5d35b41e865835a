"""Every code example in README.md and docs/ runs, against a daemon of its own: Python blocks are
executed, shell blocks run in bash (the daemon's command lines check their configuration with
`tierd --check` instead of serving), C++ blocks are compiled against the client library and run,
and TOML blocks are read by the daemon (`tierd --check --config`). So an example that stops
working fails the build.

Each fence names its language (`text` and `mermaid` are not code). The line before a fence may
say how it runs, in an HTML comment:
  <!-- not run: REASON -->       a block deliberately not run, and why
  <!-- run with: SETUP -->       run after one of SETUPS below (names the example leaves to the
                                 reader: a model, its data, a client)
A C++ block without a main() is the body of one.
"""
import os
import re
import subprocess
import sys
import tempfile

import pytest

from test_c_abi import start_daemon, stop_daemon

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
# A subject's pages in docs/<subject>/, which its headline page docs/<subject>.md lists.
SUBJECTS = sorted(d for d in os.listdir(os.path.join(ROOT, "docs"))
                  if os.path.isdir(os.path.join(ROOT, "docs", d)) and
                  any(f.endswith(".md") for f in os.listdir(os.path.join(ROOT, "docs", d))))
SUBJECT_PAGES = {s: sorted(os.path.join("docs", s, f)
                           for f in os.listdir(os.path.join(ROOT, "docs", s)) if f.endswith(".md"))
                 for s in SUBJECTS}
PAGES += [p for s in SUBJECTS for p in SUBJECT_PAGES[s]]
RUN = {"python", "sh", "cpp", "toml"}
NOT_CODE = {"text", "mermaid"}

SETUPS = {
    # A model, its data and a loss, as the optimizer's examples assume.
    "a model and its data": {"python": """
import torch
import tierd.torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
data = [(torch.randn(16, 32), torch.randint(0, 8, (16,))) for _ in range(3)]
loss_fn = torch.nn.functional.cross_entropy
x, y = data[0]
"""},
    # The example GPT (examples/train_gpt.py, 6 small blocks) and batches of its data, as the
    # streaming page assumes.
    "a GPT and its data": {"python": """
import sys
sys.path.insert(0, "examples")
import torch
import tierd.torch
from train_gpt import GPT
torch.manual_seed(0)
model = GPT(6, 64, 2, 32)
data = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 256, (4, 33))) for _ in range(3)]
"""},
    # A small llama's checkpoint, a way to build it on meta, a LoRA config, a tokenizer and an
    # output folder, as the shared base's and TRL's examples assume.
    "a checkpoint and a model on meta": {"python": """
import tempfile
import peft
import torch
import transformers
import tierd.torch
config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  max_position_embeddings=64)
torch.manual_seed(0)
ckpt = tempfile.mkdtemp()
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
def build_on_meta():
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)
lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
device = torch.device("cpu")
from tokenizers import Tokenizer, models, pre_tokenizers
words = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(
    ["<unk>", "<pad>", "</s>", "a", "short", "text", "to", "learn"])}, unk_token="<unk>"))
words.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                                 pad_token="<pad>", eos_token="</s>")
out = tempfile.mkdtemp()
"""},
    # A connected client, as the C++ examples on one call assume.
    "a client": {"cpp": """
auto connected = tierd::Client::Connect({});
if (!connected.ok()) return 1;
auto& client = *connected;
"""},
}


def blocks():
    """(page, line, language, marker kind, marker text, code) of every fenced block."""
    out = []
    for page in PAGES:
        lines = open(os.path.join(ROOT, page)).read().split("\n")
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\S*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            start = i
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != "```":
                j += 1
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            marker = re.match(r"^<!--\s*(not run|run with):\s*(.*?)\s*-->$", before.strip())
            out.append((page, start + 1, m.group(1), marker.group(1) if marker else None,
                        marker.group(2) if marker else None, "\n".join(lines[start + 1:j])))
            i = j + 1
    return out


BLOCKS = blocks()


@pytest.fixture(scope="module")
def daemon():
    # Room for the README's examples: 64 chunks of 16 MiB on the host, 256 MiB sent to NVMe.
    with tempfile.TemporaryDirectory(prefix="tierd-docs-") as root:
        proc = start_daemon(root, "--host_capacity=1280MiB", "--host_segment_size=64MiB",
                            f"--nvme_regions={root}/nvme.region:1GiB", "--device=emulated",
                            "--device_capacity=128MiB", "--device_segment_size=64MiB",
                            "--probe_bytes=0")
        yield root
        stop_daemon(proc, root)


def test_every_page_is_in_the_readmes_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", f.read()))
    assert linked == {p for p in PAGES if p.count("/") == 1}  # docs/<page>.md


@pytest.mark.parametrize("subject", SUBJECTS)
def test_every_subject_page_is_in_its_headline_pages_table(subject):
    with open(os.path.join(ROOT, "docs", subject + ".md")) as f:
        linked = set(re.findall(rf"\]\(({subject}/[\w-]+\.md)\)", f.read()))
    pages = SUBJECT_PAGES[subject]
    assert pages and linked == {os.path.relpath(p, "docs") for p in pages}


def test_links_between_pages_reach_a_page_and_its_heading():
    """A relative link to a page (and a #heading of it) lands where it points."""
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
                else os.path.join(ROOT, page)
            assert os.path.exists(file), f"{page}: link to {target}, which is not there"
            if anchor and file.endswith(".md"):
                with open(file) as f:
                    slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", f.read(), re.M)}
                assert anchor in slugs, f"{page}: link to {target}, whose heading is not there"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_every_block_says_what_it_is():
    assert len(BLOCKS) > 10
    for page, line, lang, kind, text, _ in BLOCKS:
        where = f"{page}:{line}"
        assert lang, f"{where}: a fence without a language (text or mermaid for what is not code)"
        assert lang in RUN | NOT_CODE, f"{where}: a {lang} block, which this test cannot run"
        if kind == "not run":
            assert len(text) > 10, f"{where}: say why the block is not run"
        if kind == "run with":
            assert text in SETUPS and lang in SETUPS[text], f"{where}: no setup {text!r}"


def _env(daemon, tmp_path=None):
    env = dict(os.environ, TIERD_SOCKET_DIR=daemon, PYTHONPATH=os.path.join(ROOT, "python"))
    env.pop("TIERD_JOB", None)
    if tmp_path is not None:  # what an example writes to a temporary directory goes with the test's
        env["TMPDIR"] = str(tmp_path)
    return env


def _run(args, daemon, tmp_path=None, **kwargs):
    r = subprocess.run(args, cwd=ROOT, env=_env(daemon, tmp_path), capture_output=True,
                       text=True, timeout=300, **kwargs)
    return r.returncode, r.stdout + r.stderr


def _runnable():
    return [b for b in BLOCKS if b[2] in RUN and b[3] != "not run"]


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: f"{b[0]}:{b[1]}-{b[2]}")
def test_the_example_runs(daemon, tmp_path, block):
    page, line, lang, kind, setup, code = block
    if kind == "run with":
        code = SETUPS[setup][lang] + "\n" + code
    where = f"{page}:{line}"
    if lang == "python":
        path = tmp_path / "example.py"
        path.write_text(code + "\n")
        rc, out = _run([sys.executable, str(path)], daemon, tmp_path)
    elif lang == "sh":
        # The daemon checks the configuration each command line gives it instead of serving.
        preamble = ('build/daemon/tierd() { "$TIERD_BIN" --check "$@" >/dev/null; }\n'
                    'build/tools/tierctl() { "$TIERCTL_BIN" "$@"; }\n')
        rc, out = _run(["bash", "-euo", "pipefail", "-c", preamble + code], daemon, tmp_path)
    elif lang == "toml":
        path = tmp_path / "example.toml"
        path.write_text(code + "\n")
        rc, out = _run([os.environ["TIERD_BIN"], "--check", f"--config={path}"], daemon, tmp_path)
    else:
        rc, out = _compile_and_run(code, tmp_path, daemon)
    assert rc == 0, f"{where}: the {lang} example failed:\n{code}\n---\n{out}"


def _compile_and_run(code, tmp_path, daemon):
    if "main(" not in code:
        includes = [ln for ln in code.split("\n") if ln.startswith("#include")]
        body = [ln for ln in code.split("\n") if not ln.startswith("#include")]
        code = "\n".join(["#include \"tierd/client.hpp\"", *includes, "int main() {", *body,
                          "  return 0;", "}"])
    source = tmp_path / "example.cc"
    source.write_text(code + "\n")
    library = os.environ["TIERD_CLIENT_LIB"]
    absl = subprocess.run(["pkg-config", "--cflags", "--libs", "absl_statusor", "absl_status",
                           "absl_time"], capture_output=True, text=True, check=True).stdout.split()
    binary = tmp_path / "example"
    rc, out = _run([os.environ.get("CXX", "c++"), "-std=c++20", "-Wall",
                    f"-I{os.path.join(ROOT, 'client', 'include')}", str(source), library, *absl,
                    f"-Wl,-rpath,{os.path.dirname(library)}", "-o", str(binary)], daemon, tmp_path)
    if rc != 0:
        return rc, "compiling: " + out
    return _run([str(binary)], daemon, tmp_path)
