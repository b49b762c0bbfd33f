# The example app, its bank simulator and the `idem-middleware` command, in one small image.
# docker-compose.yml runs it three ways: the migration, the app and the bank.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package build needs (pyproject names README.md as its readme and LICENSE as its
# licence file, which the installed package carries).
COPY pyproject.toml README.md LICENSE ./
COPY idem_middleware ./idem_middleware
COPY example_app ./example_app
RUN pip install ".[example]"

# Not root; the app writes nothing to disk when DATABASE_URL is set.
RUN useradd --system --no-create-home app
USER app

EXPOSE 8000 8001
CMD ["python", "-m", "example_app", "--host", "0.0.0.0", "--port", "8000"]
