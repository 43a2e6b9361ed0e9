// turnstile's web view: sign-in from a Mini App, and a run's page following its events.
"use strict";

function signInFromTelegram() {
  const form = document.getElementById("telegram-signin");
  if (!form) return;
  // Telegram hands a Mini App its signed data in the URL fragment; its own script only
  // parses it from there, so the page reads it itself (and works without that script).
  let data = "";
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.get("tgWebAppData")) data = fragment.get("tgWebAppData");
  else if (window.Telegram && Telegram.WebApp && Telegram.WebApp.initData) data = Telegram.WebApp.initData;
  if (!data) return;
  history.replaceState(null, "", location.pathname);
  form.elements["init_data"].value = data;
  document.getElementById("signing-in").hidden = false;
  form.submit();
}

function paintSwatches() {
  for (const swatch of document.querySelectorAll(".swatch[data-colour]")) {
    swatch.style.background = swatch.dataset.colour;
  }
}

function followRun() {
  const run = document.getElementById("run");
  if (!run || run.dataset.ended === "yes") return;
  const id = run.dataset.run;
  const list = document.getElementById("events");
  const source = new EventSource(`/runs/${encodeURIComponent(id)}/events?after=${run.dataset.cursor}`);
  let refreshing = null;
  const refreshTimeline = () => {
    if (refreshing) return;
    refreshing = fetch(`/runs/${encodeURIComponent(id)}/timeline`, {credentials: "same-origin"})
      .then((r) => (r.ok ? r.text() : null))
      .then((svg) => { if (svg) document.getElementById("timeline").innerHTML = svg; })
      .finally(() => { refreshing = null; });
  };
  source.addEventListener("event", (message) => {
    const event = JSON.parse(message.data);
    if (list.querySelector(`[data-id="${event.id}"]`)) return;
    const item = document.createElement("li");
    item.className = `event kind-${event.kind} fresh`;
    item.dataset.id = event.id;
    const when = document.createElement("time");
    when.textContent = event.at;
    item.append(when, " ", event.text);
    list.append(item);
    run.dataset.cursor = event.id;
    refreshTimeline();
  });
  source.addEventListener("output", (message) => {
    const box = document.getElementById("output-box");
    document.getElementById("output").textContent = JSON.parse(message.data).text;
    box.hidden = false;
  });
  source.addEventListener("ended", () => {
    source.close();
    run.dataset.ended = "yes";
    document.getElementById("live").hidden = true;
    // The final diff and status are the page's own: read it again once.
    setTimeout(() => location.reload(), 300);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  signInFromTelegram();
  paintSwatches();
  followRun();
});
