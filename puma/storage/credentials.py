"""AWS credentials: where the standard chain finds them, and keeping them out of every message.

Credentials come only from the standard AWS chain (environment, shared files, instance or pod role);
nothing here stores or logs them.
"""

from __future__ import annotations

import os

CREDENTIAL_SOURCES = {"env": "the environment", "shared-credentials-file": "~/.aws/credentials",
                      "config-file": "~/.aws/config", "iam-role": "the instance role",
                      "container-role": "the container role", "assume-role": "an assumed role",
                      "assume-role-with-web-identity": "a web identity (IRSA)", "sso": "AWS SSO"}


def credentials_source() -> str:
    """Where the AWS chain finds credentials: 'env', 'shared-credentials-file', 'iam-role', ... ('': none)."""
    import boto3

    creds = boto3.session.Session().get_credentials()
    return "" if creds is None else str(getattr(creds, "method", "") or "the AWS chain")


def redact(text: str) -> str:
    """Remove anything that looks like an AWS secret from ``text`` before logging it."""
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        value = os.environ.get(name)
        if value:
            text = text.replace(value, "***")
    return text
