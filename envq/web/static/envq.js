// envq web: refresh the live counts without reloading the page, show the actions the
// queue's state allows, reload an envelope's page when the envelope moved, and show a
// banner while the store cannot be read. No inline script anywhere (the pages' policy).
"use strict";
(function () {
  const body = document.body;
  const every = Math.max(500, parseInt(body.dataset.poll || "2000", 10));
  const queue = body.dataset.queue;
  const banner = document.getElementById("banner");
  const url = "api/counts" + (queue ? "?q=" + encodeURIComponent(queue) : "");
  const key = body.dataset.key;
  const shownState = document.querySelector("[data-envstate]");
  let wasDown = body.dataset.down === "1";

  function show(data) {
    const queues = data.queues || {};
    document.querySelectorAll("[data-count]").forEach(function (el) {
      const q = queues[el.dataset.q];
      if (!q) return;
      const n = q.counts[el.dataset.count];
      if (n !== undefined && el.textContent !== String(n)) el.textContent = String(n);
    });
    document.querySelectorAll("[data-qstate]").forEach(function (el) {
      const q = queues[el.dataset.q];
      if (q && el.textContent !== q.state) el.textContent = q.state;
    });
    document.querySelectorAll("[data-life]").forEach(function (el) {
      const q = queues[el.dataset.q];
      if (q) el.classList.toggle("current", el.dataset.life === q.state);
    });
    document.querySelectorAll("[data-when]").forEach(function (el) {
      const q = queues[el.dataset.q];
      if (q) el.hidden = el.dataset.when.split(" ").indexOf(q.state) < 0;
    });
  }

  // The envelope of this page: a new state (or none) means a page with other facts
  // and other actions, so the page is rendered again.
  async function watch() {
    const response = await fetch("api/envelope?q=" + encodeURIComponent(queue) + "&key=" + key,
      { headers: { accept: "application/json" }, cache: "no-store" });
    if (response.status === 503) return;
    const data = await response.json().catch(function () { return {}; });
    if (!response.ok || data.state !== shownState.dataset.envstate) window.location.reload();
  }

  function down(message) {
    banner.textContent = message + " — retrying every " + every / 1000 + " s";
    banner.hidden = false;
    wasDown = true;
  }

  async function poll() {
    try {
      const response = await fetch(url, { headers: { accept: "application/json" }, cache: "no-store" });
      const data = await response.json().catch(function () { return {}; });
      if (!response.ok) {
        if (response.status === 503) down(data.error || "the store cannot be read");
        return;
      }
      if (wasDown) {
        if (body.dataset.down === "1") { window.location.reload(); return; }
        banner.hidden = true;
        banner.textContent = "";
        wasDown = false;
      }
      show(data);
      if (key && queue && shownState) await watch();
    } catch (error) {
      down("the dashboard cannot be reached");
    } finally {
      window.setTimeout(poll, every);
    }
  }

  document.querySelectorAll("button[data-confirm]").forEach(function (button) {
    button.addEventListener("click", function (event) {
      if (!window.confirm(button.dataset.confirm)) event.preventDefault();
    });
  });
  window.setTimeout(poll, every);
})();
