"""Failed sign-ins are limited: after 10 failures a minute from one address, or for
one user name, the token endpoint, API tokens and the admin's login answer 429 with Retry-After;
other addresses and names are not held back. The counts are in the real Redis."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

PASSWORD = "right-horse-battery"


@pytest.fixture
def ops(db) -> User:
    return User.objects.create_user("ops", password=PASSWORD, is_staff=True, is_superuser=True)


def sign_in(password: str, username: str = "ops", address: str = "10.0.0.1"):
    return APIClient(REMOTE_ADDR=address).post(
        "/api/auth/token/", {"username": username, "password": password}, format="json"
    )


def test_the_eleventh_wrong_password_in_a_minute_is_a_429_even_with_the_right_one(ops):
    assert [sign_in("wrong").status_code for _ in range(10)] == [400] * 10

    refused = sign_in(PASSWORD)
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused.json()["detail"].startswith("too many failed sign-ins from this address or for this user")
    # The name is held back from every address; another user from another address is not.
    assert sign_in(PASSWORD, address="10.0.0.2").status_code == 429
    User.objects.create_user("dev", password=PASSWORD)
    assert sign_in(PASSWORD, username="dev", address="10.0.0.3").status_code == 200


def test_wrong_tokens_from_one_address_are_answered_429_after_ten(ops):
    bad = APIClient(REMOTE_ADDR="10.0.0.4", HTTP_AUTHORIZATION="Token " + "0" * 40)
    assert [bad.get("/api/nodes/").status_code for _ in range(10)] == [401] * 10
    refused = bad.get("/api/nodes/")
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1

    token = sign_in(PASSWORD, address="10.0.0.5").json()["token"]
    good = APIClient(REMOTE_ADDR="10.0.0.5", HTTP_AUTHORIZATION=f"Token {token}")
    assert good.get("/api/nodes/").status_code == 200, "a good token from another address is served"


def test_the_admin_login_counts_its_failures_and_answers_429_after_ten(ops, client):
    form = {"username": "ops", "password": "wrong", "next": "/admin/"}
    answers = [client.post("/admin/login/", form, REMOTE_ADDR="10.0.0.6").status_code for _ in range(10)]
    assert answers == [200] * 10, "the form shown again with its error"

    refused = client.post("/admin/login/", {**form, "password": PASSWORD}, REMOTE_ADDR="10.0.0.6")
    assert refused.status_code == 429 and "too many failed sign-ins" in refused.content.decode()
    assert sign_in(PASSWORD, address="10.0.0.7").status_code == 429, "the same name on the API too"
