// The jobs page: one row per job, newest first, each linking to its live page.
"use strict";

(() => {
  const {api, el, clear, time, badge, privacyText, epsilonText} = Plexus;

  function progress(job) {
    const unit = job.mode === "async" ? "version" : "round";
    return el("span", {class: "progress-cell"}, el("progress", {max: Math.max(job.total_rounds, 1), value: job.round}),
              ` ${unit} ${job.round} of ${job.total_rounds}`);
  }

  function row(job) {
    const href = `/jobs/${encodeURIComponent(job.job_id)}`;
    const eps = epsilonText(job.privacy);
    return el("tr", {class: "job"},
      el("td", {}, el("a", {href, class: "job-link"}, job.name), el("div", {class: "muted id"}, job.job_id)),
      el("td", {}, badge(job.status)),
      el("td", {}, progress(job)),
      el("td", {}, job.mode),
      el("td", {}, job.strategy),
      el("td", {}, privacyText(job.privacy), eps ? el("div", {class: "muted"}, eps) : null),
      el("td", {}, job.submitted_by),
      el("td", {title: time(job.updated)}, Plexus.ago(job.updated)),
      el("td", {class: "message"}, job.message));
  }

  async function load() {
    const jobs = await api("/api/jobs");
    const body = clear(document.querySelector("#jobs-table tbody"));
    jobs.forEach(job => body.append(row(job)));
    document.getElementById("empty").hidden = jobs.length > 0;
  }

  Plexus.refreshing(load);
})();
