// Shared by every page of the Plexus dashboard: the JSON API, building elements, the nav bar.
// Every text that came from the coordinator (job names, reasons, configs, site names) is set with
// textContent through el(), never as HTML: the Content-Security-Policy forbids inline scripts, and this
// keeps markup in that text from ever being markup.
"use strict";

const Plexus = (() => {
  const CSRF_HEADER = "X-Plexus-CSRF";
  let mePromise = null;

  async function api(path, options = {}) {
    const response = await fetch(path, {credentials: "same-origin", ...options});
    let body = null;
    try {
      body = await response.json();
    } catch (e) {
      body = null;
    }
    if (!response.ok) {
      const why = body && body.error ? body.error : `HTTP ${response.status}`;
      const error = new Error(why);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  function me() {
    if (mePromise === null) mePromise = api("/api/me");
    return mePromise;
  }

  async function post(path) {
    const who = await me();
    return api(path, {method: "POST", headers: {[CSRF_HEADER]: who.csrf}});
  }

  // el("td", {class: "x", title: "y"}, "text", otherElement): strings become text nodes.
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setText(id, text) {
    const node = document.getElementById(id);
    node.textContent = text === null || text === undefined ? "" : String(text);
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  }

  function time(unixSeconds) {
    if (!unixSeconds) return "";
    return new Date(unixSeconds * 1000).toLocaleString(undefined, {
      year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit",
    });
  }

  function ago(unixSeconds) {
    if (!unixSeconds) return "never";
    const s = Math.max(0, Date.now() / 1000 - unixSeconds);
    if (s < 90) return `${Math.round(s)} s ago`;
    if (s < 5400) return `${Math.round(s / 60)} min ago`;
    if (s < 129600) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} days ago`;
  }

  function number(value, digits = 4) {
    if (value === null || value === undefined) return "";
    return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  }

  function badge(status) {
    // "closed (evaluation)" is coloured as "closed"
    const kind = String(status).split(" ")[0].replace(/[^a-z_]/g, "");
    return el("span", {class: `badge status-${kind}`}, status || "—");
  }

  function privacyText(privacy) {
    const parts = [];
    if (privacy.dp) parts.push(privacy.dp);
    if (privacy.secure_aggregation) parts.push("secure aggregation");
    return parts.length ? parts.join("; ") : "none";
  }

  function epsilonText(privacy) {
    if (privacy.epsilon_spent === null && privacy.epsilon_target === null) return "";
    const spent = privacy.epsilon_spent === null ? "0" : privacy.epsilon_spent.toFixed(3);
    return privacy.epsilon_target === null ? `ε ${spent}` : `ε ${spent} of ${privacy.epsilon_target}`;
  }

  function showError(error) {
    const node = document.getElementById("error");
    if (!node) return;
    if (error) {
      node.textContent = error.status === 401
        ? `${error.message} (the dashboard restarted? open the URL it printed)`
        : String(error.message || error);
      node.hidden = false;
    } else {
      node.hidden = true;
      node.textContent = "";
    }
  }

  async function nav() {
    const page = document.body.dataset.page;
    const links = [["jobs", "/", "Jobs"], ["sites", "/sites", "Sites"], ["audit", "/audit", "Audit log"]];
    const bar = clear(document.getElementById("nav"));
    bar.append(el("a", {class: "brand", href: "/"}, "Plexus"));
    for (const [key, href, label] of links) {
      bar.append(el("a", {href, class: key === page || (page === "job" && key === "jobs") ? "active" : ""}, label));
    }
    const who = el("span", {class: "who", id: "who"});
    bar.append(el("span", {class: "spacer"}), who);
    try {
      const m = await me();
      who.append(el("span", {}, "as "), el("strong", {}, m.name), el("span", {class: `role role-${m.role}`}, m.role),
                 el("span", {class: "muted"}, ` coordinator ${m.coordinator}`));
    } catch (e) {
      showError(e);
    }
  }

  // A page with a Refresh button: run load() now and on each click, saying when it last succeeded.
  function refreshing(load) {
    const stamp = document.getElementById("refreshed");
    async function run() {
      try {
        await load();
        showError(null);
        if (stamp) stamp.textContent = `as of ${new Date().toLocaleTimeString()}`;
      } catch (e) {
        showError(e);
      }
    }
    const button = document.getElementById("refresh");
    if (button) button.addEventListener("click", run);
    return run();
  }

  document.addEventListener("DOMContentLoaded", nav);

  return {api, me, post, el, setText, clear, time, ago, number, badge, privacyText, epsilonText, showError,
          refreshing};
})();
