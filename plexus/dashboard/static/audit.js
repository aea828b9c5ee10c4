// The audit page: whether the coordinator's hash chain verifies, and its latest entries, newest first.
"use strict";

(() => {
  const {api, el, clear, time} = Plexus;

  async function load() {
    const log = await api("/api/audit");
    const verdict = clear(document.getElementById("verified"));
    verdict.className = log.verified ? "verdict ok" : "verdict bad";
    if (log.verified) {
      verdict.append(el("span", {class: "mark"}, "✓"), ` hash chain verified: ${log.count} entries, intact`);
    } else {
      verdict.append(el("span", {class: "mark"}, "✗"), " not verified: ", el("span", {id: "problem"},
                     log.problem || "the coordinator gave no reason"), ` (${log.count} entries)`);
    }
    const body = clear(document.querySelector("#audit-table tbody"));
    for (const e of log.entries.slice().reverse()) {
      body.append(el("tr", {},
        el("td", {}, e.seq), el("td", {}, time(e.at)), el("td", {}, e.actor), el("td", {}, e.action),
        el("td", {}, e.subject)));
    }
  }

  Plexus.refreshing(load);
})();
