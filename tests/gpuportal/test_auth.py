"""The token cache: a remembered token past its few seconds is trusted at once while a thread looks
it up again, so a frozen database does not hold up a request that needs nothing else from it."""

from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth.models import User
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token
from rest_framework.exceptions import AuthenticationFailed

from gpuportal import auth

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def key() -> str:
    auth.forget_tokens()
    return Token.objects.create(user=User.objects.create_user("caller")).key


@pytest.fixture
def frozen_database(monkeypatch):
    """Each look-up waits for `thaw` (a database that does not answer), and says when it ended."""
    thaw, looked_up = threading.Event(), threading.Event()
    look_up = TokenAuthentication.authenticate_credentials

    def slow(self, key):
        try:
            assert thaw.wait(30), "the test never let the database answer"
            return look_up(self, key)
        finally:
            looked_up.set()

    monkeypatch.setattr(TokenAuthentication, "authenticate_credentials", slow)
    return thaw, looked_up


def join_look_ups() -> None:
    for thread in threading.enumerate():
        if thread.name == f"{auth._tokens.name}-look-up":
            thread.join(30)


def expire(key: str, *, stale_for_s: float) -> None:
    """The remembered entry past its fresh seconds, still trusted for `stale_for_s`."""
    _, _, found = auth._tokens._entries[key]
    auth._tokens._entries[key] = (time.monotonic() - 1, time.monotonic() + stale_for_s, found)


def test_a_remembered_token_past_its_ttl_is_trusted_at_once_while_it_is_looked_up_again(key, frozen_database):
    thaw, looked_up = frozen_database
    thaw.set()
    user, _ = auth._authenticator.authenticate_credentials(key)
    looked_up.clear()
    thaw.clear()
    expire(key, stale_for_s=60)

    again, _ = auth._authenticator.authenticate_credentials(key)  # the database does not answer yet

    assert again == user and not looked_up.is_set(), "answered without waiting for the database"
    thaw.set()
    join_look_ups()
    fresh_until = auth._tokens._entries[key][0]
    assert looked_up.is_set() and fresh_until > time.monotonic(), "fresh again once the look-up came back"


def test_a_token_revoked_meanwhile_is_refused_from_the_request_after_the_look_up(key, frozen_database):
    thaw, looked_up = frozen_database
    thaw.set()
    auth._authenticator.authenticate_credentials(key)
    looked_up.clear()
    Token.objects.filter(key=key).delete()
    expire(key, stale_for_s=60)

    auth._authenticator.authenticate_credentials(key)  # trusted once more, while it is looked up
    join_look_ups()
    assert looked_up.is_set() and key not in auth._tokens._entries, "the look-up forgot the revoked token"

    with pytest.raises(AuthenticationFailed):
        auth._authenticator.authenticate_credentials(key)


def test_past_the_stale_window_a_token_is_looked_up_before_the_answer(key, frozen_database):
    thaw, looked_up = frozen_database
    thaw.set()
    auth._authenticator.authenticate_credentials(key)
    looked_up.clear()
    Token.objects.filter(key=key).delete()
    expire(key, stale_for_s=-1)

    with pytest.raises(AuthenticationFailed):
        auth._authenticator.authenticate_credentials(key)
    assert looked_up.is_set(), "looked up in the request itself"


@pytest.mark.parametrize("keyword", ["Token", "Bearer"])
def test_a_token_is_taken_under_either_keyword_on_the_api_as_on_v1(key, keyword):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{keyword} {key}")

    assert client.get("/api/deployments/").status_code == 200
    assert client.get("/v1/models").status_code == 200
    client.credentials(HTTP_AUTHORIZATION=f"{keyword} not-{key}")
    refused = client.get("/api/deployments/")
    assert refused.status_code == 401 and refused.json()["detail"] == "Invalid token."
