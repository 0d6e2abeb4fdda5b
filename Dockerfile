# One image for every role of p2p-diloco; the command picks the role:
#
#   docker build -t p2p-diloco .
#   docker run --rm p2p-diloco peer --help
#   docker run -d --name bootstrap -p 31337:31337/tcp -p 31337:31337/udp --shm-size=1g \
#       -v p2p-diloco-state:/var/lib/p2p-diloco p2p-diloco bootstrap --config /etc/p2p-diloco/bootstrap.toml
#   docker run -d --name peer --gpus all --shm-size=8g -p 31337:31337/tcp -p 31337:31337/udp \
#       -v "$PWD/runs:/workspace/runs" -v hf-cache:/cache/huggingface \
#       p2p-diloco peer --config /opt/p2p-diloco/peers/machine-80gb.toml --run.run_id c4-400m --initial-peers /ip4/.../p2p/Qm...
#
# /dev/shm: hivemind's averager keeps the pseudo-gradient buffers in shared memory and moves them between its
# processes through /dev/shm. Docker gives containers 64 MB, far too little for a model of any size: run peers with
# --shm-size=8g (more for models above ~1B parameters) or --ipc=host.
#
# CUDA: the base image brings torch built for CUDA 12.8, which needs a recent NVIDIA driver on the host and the
# NVIDIA Container Toolkit (for --gpus). For another CUDA or torch version pick another base image:
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<version>-cuda<x.y>-cudnn9-runtime -t p2p-diloco .
# The same image runs on CPU-only hosts (run.device=auto falls back to the CPU).
#
# Any base image with Python >= 3.10 and its venv module works; one without torch gets it from pip, and PIP_ARGS
# picks which. A small CPU-only image from Debian's Python (how it was built and tested, README "Docker"):
#   docker build --build-arg BASE_IMAGE=debian-python:bookworm \
#       --build-arg PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu" -t p2p-diloco:cpu .
# A multi-GPU machine is one peer: append --nproc-per-node N to the peer command (torchrun starts one process per
# GPU inside the container).
#
# hivemind 1.1.12 is installed from its manylinux x86_64 wheel, which ships the p2pd binary: no Go toolchain is
# needed, and the image is x86_64 only.

ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
# extra arguments for the pip install of the package (an index, a pinned torch build)
ARG PIP_ARGS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface

WORKDIR /opt/p2p-diloco

# A virtual environment over the base image's Python: it sees the base image's packages (torch in the CUDA image,
# which satisfies the project's torch>=2.1, so pip keeps it and its CUDA build as is), and pip may install into it
# where the system Python is externally managed (PEP 668: Debian's python3).
RUN python3 -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:$PATH

COPY pyproject.toml README.md ./
COPY p2p_diloco ./p2p_diloco
RUN pip install ${PIP_ARGS} . \
 && python -c "import p2p_diloco.net.dht, p2p_diloco.net.averaging, p2p_diloco.peer" \
 && test -x "$(python -c 'import hivemind, os; print(os.path.dirname(hivemind.__file__))')/hivemind_cli/p2pd"

# Run configs (data, not code): peers/*.toml, and the bootstrap node's default config.
COPY peers ./peers
COPY bootstrap/bootstrap.toml /etc/p2p-diloco/bootstrap.toml

# Relative run_dir values in the configs (runs/...) land here; mount a host folder on /workspace/runs to keep them.
WORKDIR /workspace

# The fixed port of bootstrap/bootstrap.toml and peers/machine-{80gb,24gb}.toml: TCP, and UDP for QUIC.
EXPOSE 31337/tcp 31337/udp

ENTRYPOINT ["p2p-diloco"]
CMD ["--help"]
