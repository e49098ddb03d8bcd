from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request

from gpuportal.wire.pages import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE


class Pagination(PageNumberPagination):
    """DRF's page numbers, but a `page` or `page_size` that is not a whole number in bounds is a
    400 naming it, as every other bad query parameter is (DRF's own falls back to the default
    size, or clamps it, without a word). A page past the last is DRF's 404."""

    page_size = DEFAULT_PAGE_SIZE
    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE_SIZE

    def get_page_size(self, request: Request) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        return self.page_size if raw is None else _whole(self.page_size_query_param, raw, self.max_page_size)

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list | None:
        raw = request.query_params.get(self.page_query_param)
        if raw is not None and raw not in self.last_page_strings:
            _whole(self.page_query_param, raw)
        return super().paginate_queryset(queryset, request, view)


def _whole(name: str, raw: str, most: int | None = None) -> int:
    """`raw` as a whole number from 1 (to `most`), or a 400 naming the parameter, in the words
    DRF's own fields use."""
    try:
        return serializers.IntegerField(min_value=1, max_value=most).run_validation(raw)
    except ValidationError as err:
        raise ValidationError({name: err.detail}) from None
