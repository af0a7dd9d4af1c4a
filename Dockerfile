# The project's image: worker.py, starter.py, the vault proxy and the Stripe emulator.
FROM python:3.11-slim

# Two malloc arenas: the worker's threads otherwise keep growing free memory in theirs
# (devstack/stack.py WORKER_ENV says what was measured).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml ./
COPY billing/ billing/
COPY cli/ cli/
COPY workflows/ workflows/
COPY activities/ activities/
COPY vault/ vault/
COPY stripe_emulator/ stripe_emulator/
COPY devstack/ devstack/
COPY migrations/ migrations/
COPY worker.py starter.py ./
# Editable, so the code runs from /app next to migrations/ (which is not package data);
# no dev extras: tests and linters stay out of the image. The workflows are compiled here:
# the sandbox loads them for every workflow run, and the worker cannot write to /app.
RUN pip install -e . \
    && python -m compileall -q workflows \
    && useradd --system --uid 10001 --no-create-home --home-dir /app billing

USER billing
CMD ["python", "worker.py"]
