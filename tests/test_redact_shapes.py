"""The secret shapes redaction knows, as a table: each positive is hidden (and what a
reader needs around it stays), each negative is left exactly as it was. Plus bounds:
redacting a typical chat message is fast, and hostile inputs cannot make it slow."""

from __future__ import annotations

import pytest

from bot.render import render_markdown
from engine.redact import REDACTED, Redactor, is_credential_name, redact

RSA_BODY = "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi\nZ1BjP5CE/Wm/Rr500P\nZ1BjP5CE/Wm/Rr500Q="
OPENSSH_BODY = "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\nAAAAAAAAAAEAAAAzAAAAC3NzaC1lZDI1"
PGP_BODY = "Version: GnuPG v2\n\nlQOYBF9xyzABCADE3f4g5h6i7j8k9l0m\n=abcd"
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0"
    ".dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
)
SLACK_HOOK = "T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX"
DISCORD_HOOK = "123456789012345678/abcdefghijklmnopqrstuvwxyz_ABCDEFGHIJ-0123456789"
TEAMS_HOOK = (
    "webhookb2/0a1b2c3d-aaaa-bbbb-cccc-0123456789ab@0a1b2c3d-dddd-eeee-ffff-0123456789ab"
    "/IncomingWebhook/0123456789abcdef0123456789abcdef/0a1b2c3d-1111-2222-3333-0123456789ab"
)
BOT_TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq"

# (what it is, the text, what must be gone, what must stay)
POSITIVE = [
    (
        "PEM RSA private key",
        f"key:\n-----BEGIN RSA PRIVATE KEY-----\n{RSA_BODY}\n-----END RSA PRIVATE KEY-----\nafter",
        RSA_BODY.split("\n")[1],
        "after",
    ),
    (
        "PKCS#8 private key",
        f"-----BEGIN PRIVATE KEY-----\n{RSA_BODY}\n-----END PRIVATE KEY-----",
        "MIIEpAIBAAK",
        "",
    ),
    (
        "encrypted PEM key",
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,"
        f"0A1B\n\n{RSA_BODY}\n-----END ENCRYPTED PRIVATE KEY-----",
        "Wm/Rr500P",
        "",
    ),
    (
        "EC key",
        f"-----BEGIN EC PRIVATE KEY-----\n{RSA_BODY}\n-----END EC PRIVATE KEY-----",
        "Rr500Q",
        "",
    ),
    (
        "OpenSSH private key",
        f"-----BEGIN OPENSSH PRIVATE KEY-----\n{OPENSSH_BODY}\n-----END OPENSSH PRIVATE KEY-----"
        "\nthen text",
        "C3NzaC1lZDI1",
        "then text",
    ),
    (
        "PGP private key",
        f"-----BEGIN PGP PRIVATE KEY BLOCK-----\n{PGP_BODY}\n-----END PGP PRIVATE KEY BLOCK-----",
        "lQOYBF9xyz",
        "",
    ),
    (
        "a key block cut short",
        f"the file starts:\n-----BEGIN OPENSSH PRIVATE KEY-----\n{OPENSSH_BODY}\n",
        "b3BlbnNzaC1rZXkt",
        "the file starts:",
    ),
    (
        "PuTTY private key",
        "PuTTY-User-Key-File-3: ssh-ed25519\nPrivate-Lines: 1\nAAAAIOx1Q2W3e4R5t6Y7u8I9o0P\n"
        "Private-MAC: 0123",
        "AAAAIOx1Q2W3e4R5t6Y7u8I9o0P",
        "Private-Lines: 1",
    ),
    ("*_PASS=", "DB_PASS=hunter2hunter2", "hunter2", "DB_PASS="),
    ("*_PASSWORD=", "SMTP_PASSWORD=correct-horse", "correct-horse", "SMTP_PASSWORD="),
    ("*_SECRET=", "APP_SECRET=s3cr3t-v4lue", "s3cr3t-v4lue", "APP_SECRET="),
    ("*_TOKEN=", "CI_JOB_TOKEN=opaque0987654321", "opaque0987654321", "CI_JOB_TOKEN="),
    ("*_KEY=", "STRIPE_KEY=zzzyyyxxx123", "zzzyyyxxx123", "STRIPE_KEY="),
    ("*_PWD=", "MYSQL_PWD=abcdef1234", "abcdef1234", "MYSQL_PWD="),
    ("export NAME=value", "export FOO_API_KEY='q1w2e3r4t5y6'", "q1w2e3r4t5y6", "FOO_API_KEY="),
    ("set NAME value", "set FOO_API_KEY abcdef123456789", "abcdef123456789", "FOO_API_KEY"),
    ("set -gx (fish)", "set -gx DB_PASS hunter2hunter2", "hunter2", "DB_PASS"),
    ("setx (Windows)", 'setx GH_TOKEN "opaque0987654321"', "opaque0987654321", "GH_TOKEN"),
    ("setenv (csh)", "setenv AWS_SECRET_KEY abc123def456", "abc123def456", "AWS_SECRET_KEY"),
    ("set NAME=value (cmd)", "set DB_PASSWORD=hunter2hunter2", "hunter2", "DB_PASSWORD="),
    ("Dockerfile ENV", "ENV DB_PASSWORD hunter2hunter2", "hunter2", "DB_PASSWORD"),
    ("YAML NAME: value", "  db_password: hunter2hunter2", "hunter2", "db_password:"),
    ("YAML quoted", '  api_key: "abc def ghi jkl"', "def ghi", "api_key:"),
    ("JSON", '{"client_secret": "zxcvbnm12345", "id": 7}', "zxcvbnm12345", '"id": 7'),
    ("JSON camelCase", '{"dbPassword": "zxcvbnm12345"}', "zxcvbnm12345", "dbPassword"),
    ("camelCase Key", "secretKey: qwertyuiop12", "qwertyuiop12", "secretKey"),
    ("INI with spaces", "[db]\npassword = 'two words here'", "two words", "[db]"),
    ("PowerShell", '$env:DB_PASS = "hunter2hunter2"', "hunter2", "$env:DB_PASS"),
    ("Go :=", 'apiToken := "abcdef123456"', "abcdef123456", "apiToken"),
    ("command-line flag", "mysql --password hunter2hunter2 -h db", "hunter2", "-h db"),
    ("Slack webhook", f"https://hooks.slack.com/services/{SLACK_HOOK}", "XXXXXXXX", "slack.com"),
    (
        "Discord webhook",
        f"post to https://discord.com/api/webhooks/{DISCORD_HOOK} now",
        "abcdefghijklmnop",
        "now",
    ),
    (
        "Teams webhook",
        f"https://contoso.webhook.office.com/{TEAMS_HOOK}",
        "IncomingWebhook/0123456789abcdef",
        "webhook.office.com",
    ),
    (
        "old Teams webhook",
        f"https://outlook.office.com/{TEAMS_HOOK.replace('webhookb2', 'webhook')}",
        "0123456789abcdef0123",
        "outlook.office.com",
    ),
    (
        "signed workflow URL",
        "https://prod-01.westus.logic.azure.com:443/workflows/abc/triggers/manual/paths/invoke"
        "?api-version=2016-06-01&sp=%2Ftriggers&sv=1.0&sig=AbCdEfGhIjKlMnOpQrStUvWxYz012",
        "AbCdEfGhIjKlMnOp",
        "api-version=2016-06-01",
    ),
    ("Telegram bot token", f"token {BOT_TOKEN} ok", "AAHdqTcvCH1v", "ok"),
    (
        "Telegram bot token in an API URL",
        f"https://api.telegram.org/bot{BOT_TOKEN}/sendMessage",
        "AAHdqTcvCH1v",
        "/sendMessage",
    ),
    ("GitHub classic token", "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_abcdef", ""),
    ("GitHub OAuth token", "gho_16C7e42F292c6912E7710c838347Ae178B4a", "16C7e42F292c", ""),
    (
        "GitHub fine-grained token",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ",
        "abcdefghijklmnop",
        "",
    ),
    ("GitLab token", "glpat-abcdefghij0123456789", "abcdefghij0123456789", ""),
    ("GitLab runner token", "glrt-abcdefghij0123456789ab", "abcdefghij0123456789", ""),
    ("AWS access key id", "AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE", ""),
    ("AWS session key id", "id ASIAY34FZKBOKMUTVV7A ok", "ASIAY34FZKBOKMUTVV7A", "ok"),
    (
        "AWS secret (credentials file)",
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "wJalrXUtnFEMI",
        "aws_secret_access_key",
    ),
    ("JWT", f"cookie {JWT} end", "dozjgNryP4J3", "end"),
    ("URL with a password", "https://deploy:Hunter2Hunter2@git.example/r.git", "Hunter2", "@git"),
    ("Authorization: Basic", "Authorization: Basic dXNlcjpodW50ZXIy", "dXNlcjpodW50ZXIy", ""),
    ("Authorization: token", "Authorization: token opaque0987654321", "opaque0987654321", ""),
    ("Proxy-Authorization", "Proxy-Authorization: Basic dXNlcjpodW50ZXIy", "dXNlcjpo", "Proxy-"),
    ("Bearer", "curl -H 'Authorization: Bearer abc.def.ghi'", "abc.def.ghi", "curl"),
    ("curl -u", "curl -u admin:hunter2hunter2 https://x.example", "hunter2", "admin:"),
    ("OpenAI key", "sk-proj-abcdefghijklmnop0123", "abcdefghijklmnop", ""),
    ("Anthropic key", "sk-ant-api03-abcdefghijklmnop0123", "abcdefghijklmnop", ""),
    ("Stripe secret key", "sk_live_abcdefghij0123456789", "abcdefghij0123456789", ""),
    ("Slack bot token", "xoxb-1234567890-abcdefghijkl", "abcdefghijkl", ""),
    ("Google API key", "AIzaSyA-abcdefghijklmnopqrstuvwxyz01234", "abcdefghijklmnop", ""),
    ("npm token", "npm_abcdefghijklmnopqrstuvwxyz0123456789", "abcdefghijklmnop", ""),
    ("Hugging Face token", "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH", "abcdefghijklmnop", ""),
    (
        "SendGrid key",
        "SG.abcdefghijklmnopqrstuv.abcdefghijklmnopqrstuvwxyz0123456789ABCDEFG",
        "abcdefghijklmnopqrstuvwxyz0123",
        "",
    ),
    (
        "PyPI token",
        "pypi-AgEIcHlwaS5vcmcCJGFiY2RlZmdoLWlqa2wtbW5vcC1xcnN0LXV2d3h5ejAxMjM0AAIqWzMsImFi",
        "cHlwaS5vcmcCJGFi",
        "",
    ),
]

# Ordinary prose and code that must come out exactly as it went in.
NEGATIVE = [
    "commit 3f786850e387550fdab836ed7e6dc881de23001b fixed the bug",
    "request 123e4567-e89b-12d3-a456-426614174000 finished in 3ms",
    "sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "input_tokens: 123456789, max_tokens=4096000",
    "tokenizer: wordpiece; secretary: Jane Q.",
    "PWD=/home/someone/project OLDPWD=/home/someone",
    "SORT_KEY=created_at PRIMARY_KEY=user_id cache_key: user-profile-42",
    "PUBLIC_KEY=ssh-ed25519-AAAAC3NzaC1lZDI1NTE5",
    "set token expiry to one hour",
    "bypass=enabled keyboard: qwerty-layout",
    "The password must be at least twelve characters long.",
    "Bearer tokens expire after an hour; the authorization header is required.",
    "docker run -u 1000:1000 image",
    "-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8A\n-----END PUBLIC KEY-----",
    "see https://github.com/acme/web/pull/12?tab=files&page=2",
    "def make_key(name: str) -> str:\n    return name.upper()",
    "Ran 42 tests in 1.3s. OK",
]


@pytest.mark.parametrize(
    ("text", "gone", "kept"),
    [pytest.param(text, gone, kept, id=name) for name, text, gone, kept in POSITIVE],
)
def test_a_secret_shape_is_hidden(text: str, gone: str, kept: str) -> None:
    out = redact(text)
    assert gone not in out
    assert REDACTED in out
    assert kept in out


@pytest.mark.parametrize("text", NEGATIVE)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact(text) == text


@pytest.mark.parametrize(
    ("name", "credential"),
    [
        ("DB_PASS", True),
        ("SMTP_PWD", True),
        ("STRIPE_KEY", True),
        ("dbPassword", True),
        ("PWD", False),
        ("OLDPWD", False),
        ("SSH_ASKPASS", False),
        ("SORT_KEY", False),
        ("PUBLIC_KEY", False),
        ("MONKEY", False),
    ],
)
def test_which_variables_hold_credentials(name: str, credential: bool) -> None:
    assert is_credential_name(name) is credential


def test_a_private_key_in_a_chat_message_is_hidden_in_the_rendered_text() -> None:
    markdown = (
        "Here is the key:\n\n```\n-----BEGIN OPENSSH PRIVATE KEY-----\n"
        f"{OPENSSH_BODY}\n-----END OPENSSH PRIVATE KEY-----\n```\n\n**done**"
    )
    [msg] = render_markdown(markdown, redact=Redactor(), document_threshold=10_000)
    assert "C3NzaC1lZDI1" not in msg.text
    assert "b3BlbnNzaC1rZXkt" not in msg.text
    assert REDACTED in msg.text
    assert msg.text.endswith("done")


def test_two_key_blocks_hide_only_themselves() -> None:
    text = (
        f"-----BEGIN RSA PRIVATE KEY-----\n{RSA_BODY}\n-----END RSA PRIVATE KEY-----\n"
        "between\n"
        f"-----BEGIN OPENSSH PRIVATE KEY-----\n{OPENSSH_BODY}\n-----END OPENSSH PRIVATE KEY-----"
    )
    assert redact(text) == f"{REDACTED}\nbetween\n{REDACTED}"


@pytest.mark.parametrize(
    "hostile",
    [
        "-----BEGIN RSA PRIVATE KEY-----\n" * 3_000,
        "-----BEGIN RSA PRIVATE KEY-----\n" + "a b c;" * 16_000,
        "token=" * 20_000,
        "DB_TOKEN_A_B_C_D = " * 5_000,
        "set A_TOKEN " * 8_000,
        "://a:" * 20_000,
        'password="' + "x" * 100_000,
        "Private-Lines: 4\n" + "QUFB\n" * 20_000,
        "aKey" * 25_000,
        "a_" * 50_000,
        "1234567:" * 12_000,
    ],
    ids=lambda s: repr(s[:16]),
)
@pytest.mark.timeout(20)
def test_hostile_input_cannot_make_redaction_hang(hostile: str) -> None:
    # A pattern that backtracks without end would hang here until the timeout (how long
    # redaction takes is bench/bench_redact.py's to say).
    out = redact(hostile)
    assert isinstance(out, str)


def test_a_url_whose_user_name_looks_like_a_credential_keeps_its_host() -> None:
    # (The user "turnstile_pw" ends like DB_PW: only the password goes, not the host.)
    text = "at postgresql://turnstile_pw:hunter2hunter2@127.0.0.1:5432/doctor_pw: 2 pending"
    assert (
        redact(text)
        == f"at postgresql://turnstile_pw:{REDACTED}@127.0.0.1:5432/doctor_pw: 2 pending"
    )
    assert redact("db_pw:hunter2hunter2 and more") == f"db_pw:{REDACTED} and more"
