// The sites page: who is online, when each site was last seen, its datasets' rows, its certificate.
"use strict";

(() => {
  const {api, el, clear, time, ago} = Plexus;

  function datasets(site) {
    const names = site.datasets.length ? site.datasets : Object.keys(site.dataset_rows);
    if (!names.length) return "—";
    return names.map(name => name in site.dataset_rows ? `${name}: ${site.dataset_rows[name]} rows` : name).join(", ");
  }

  function row(site) {
    return el("tr", {class: site.revoked ? "site revoked" : "site"},
      el("td", {class: "site-name"}, site.site),
      el("td", {}, el("span", {class: site.online ? "dot online" : "dot offline"}), site.online ? "online" : "offline"),
      el("td", {title: time(site.last_seen)}, ago(site.last_seen)),
      el("td", {class: "site-rows"}, datasets(site)),
      el("td", {class: site.revoked ? "revoked-cell" : ""}, site.revoked ? "REVOKED" : "valid"),
      el("td", {}, site.version),
      el("td", {class: "mono", title: site.policy_digest}, site.policy_digest.slice(0, 16)));
  }

  async function load() {
    const sites = await api("/api/sites");
    const body = clear(document.querySelector("#sites-table tbody"));
    sites.forEach(site => body.append(row(site)));
    document.getElementById("empty").hidden = sites.length > 0;
  }

  Plexus.refreshing(load);
})();
