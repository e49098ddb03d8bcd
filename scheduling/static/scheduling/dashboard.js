// The GPU dashboard: refresh the body from the fragment view every few seconds, and ask
// before destructive controls. Plain JS, no build step; the page works without it (the server
// asks for confirmation itself, and a reload refreshes).
"use strict";

(function () {
  const root = document.getElementById("gp-dashboard");
  if (!root) return;
  const body = document.getElementById("gp-body");
  const stamp = document.getElementById("gp-refreshed");
  const interval = Number(root.dataset.refreshMs) || 3000;

  // A refresh must not wipe what the operator is typing (e.g. a scale figure).
  function busy() {
    const active = document.activeElement;
    return active && body.contains(active) && active.tagName === "INPUT";
  }

  async function refresh() {
    if (busy()) return;
    try {
      // The same query string as the page, so the event filters apply to the fragment too.
      const response = await fetch(root.dataset.fragmentUrl + window.location.search, {
        credentials: "same-origin",
        headers: { "X-Requested-With": "fetch" },
      });
      if (!response.ok) {
        stamp.textContent = "Refresh failed (" + response.status + "); retrying";
        return;
      }
      const html = await response.text();
      if (busy()) return;
      body.innerHTML = html;
      const rendered = document.getElementById("gp-rendered-at");
      stamp.textContent = "Refreshed " + (rendered ? rendered.textContent : "");
    } catch (err) {
      stamp.textContent = "Refresh failed (" + err + "); retrying";
    }
  }

  // Delegated, so forms swapped in by a refresh are covered too.
  document.addEventListener("submit", function (event) {
    const form = event.target;
    if (!form.classList || !form.classList.contains("gp-control")) return;
    let question = form.dataset.confirm;
    if (form.classList.contains("gp-scale")) {
      const wanted = Number(form.elements.replicas.value);
      if (!(wanted < Number(form.dataset.current))) question = null; // only scaling down asks
    }
    if (!question) return;
    if (!window.confirm(question)) {
      event.preventDefault();
      return;
    }
    form.elements.confirm.value = "yes";
  });

  window.setInterval(refresh, interval);
})();
