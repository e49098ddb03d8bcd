"""Node credentials: the hash of each node's token, for the agents' calls to be checked against."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0031_deployment_observed"),
    ]

    operations = [
        migrations.CreateModel(
            name="NodeCredential",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "node",
                    models.SlugField(help_text="The node's name, as its agent's --node.", max_length=100, unique=True),
                ),
                (
                    "token_hash",
                    models.CharField(
                        db_index=True,
                        help_text="sha256 of the token, hex: the token itself is not kept.",
                        max_length=64,
                    ),
                ),
                ("created_at", models.DateTimeField(help_text="When this token was issued (a re-issue replaces it).")),
                ("created_by", models.CharField(blank=True, max_length=150)),
                ("revoked_at", models.DateTimeField(blank=True, db_index=True, null=True)),
                (
                    "last_used_at",
                    models.DateTimeField(blank=True, help_text="A call carried it (to the minute).", null=True),
                ),
            ],
            options={
                "ordering": ["node"],
            },
        ),
    ]
