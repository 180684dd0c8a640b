package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab/labcluster"
)

const metricsAddr = "127.0.0.1:9464"

// scrape fetches host's /metrics over HTTP from inside the host's network namespace (the endpoint listens
// on the host's loopback) and returns each sample by its series, as exposed: `name{labels}` -> value.
func scrape(t *testing.T, c *labcluster.Cluster, host string) map[string]float64 {
	t.Helper()
	tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		var conn net.Conn
		err := c.Lab.Do(host, func() error {
			var err error
			conn, err = (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, network, addr)
			return err
		})
		return conn, err
	}}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	resp, err := cl.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", host, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("scrape %s: %s: %s", host, resp.Status, b)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if i < 0 || err != nil {
			t.Fatalf("scrape %s: bad sample line %q", host, line)
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("scrape %s: %v", host, err)
	}
	return out
}

// pollMetrics scrapes host until ok accepts the samples; timeout is only a failure bound.
func pollMetrics(t *testing.T, c *labcluster.Cluster, host, what string, timeout time.Duration, ok func(m map[string]float64) bool) map[string]float64 {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		m := scrape(t, c, host)
		if ok(m) {
			return m
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; last scrape of %s:\n%v", what, timeout, host, ftkitSamples(m))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ftkitSamples lists the ftkit_ samples of a scrape, for a failure message.
func ftkitSamples(m map[string]float64) string {
	var b strings.Builder
	for k, v := range m {
		if strings.HasPrefix(k, "ftkit_") {
			fmt.Fprintf(&b, "%s %g\n", k, v)
		}
	}
	return b.String()
}

// TestMetricsMove: every agent serves /metrics on metrics.listen, and the values follow what the agent
// does: a job starts (jobs running goes up), it is snapshotted and replicated (snapshot count, frozen time,
// shipping, replica age), a manual checkpoint adds one more, the sender-side log grows with the job's
// traffic to the other host, heartbeats flow both ways.
func TestMetricsMove(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", MetricsListen: metricsAddr})
	ctx := context.Background()

	before := scrape(t, c, "node1")
	for series, want := range map[string]float64{
		`ftkit_jobs{state="running"}`: 0, "ftkit_snapshots_total": 0, "ftkit_jobs_unreplicated": 0,
		"ftkit_log_logged_bytes_total": 0,
	} {
		if got, ok := before[series]; !ok || got != want {
			t.Errorf("before any job: %s = %v (present %v), want %v", series, got, ok, want)
		}
	}
	if before["ftkit_log_memory_cap_bytes"] <= 0 || before["go_goroutines"] <= 0 || before["process_resident_memory_bytes"] <= 0 {
		t.Errorf("log cap, Go and process collectors missing: %s", ftkitSamples(before))
	}

	// A two-rank ring across both hosts: each rank sends to the other host, so each host logs bytes.
	st := c.Lab.State()
	peers := st.Hosts[0].Addr.Addr().String() + ":7500," + st.Hosts[1].Addr.Addr().String() + ":7500"
	jobs := map[string]string{}
	for r, h := range st.Hosts {
		_, _, job := startWrapped(t, c, h.Name, fmt.Sprintf("rank%d", r), bins.Ringstencil, "--rank", fmt.Sprint(r),
			"--peers", peers, "--iters", "1000000", "--block", "16384", "--delay", "5ms")
		jobs[h.Name] = job
	}
	job := jobs["node1"]
	replicaAge := fmt.Sprintf(`ftkit_job_replica_age_seconds{job=%q}`, job)

	// The job's first snapshot is taken as it starts and shipped to node2.
	m1 := pollMetrics(t, c, "node1", "job running, snapshotted and replicated", 2*time.Minute, func(m map[string]float64) bool {
		_, aged := m[replicaAge]
		return m[`ftkit_jobs{state="running"}`] == 1 && m["ftkit_snapshots_total"] >= 1 && m["ftkit_snapshot_ships_total"] >= 1 &&
			aged && m["ftkit_jobs_unreplicated"] == 0
	})
	if m1["ftkit_snapshot_frozen_seconds_count"] != m1["ftkit_snapshots_total"] || m1["ftkit_snapshot_frozen_seconds_sum"] <= 0 ||
		m1["ftkit_snapshot_size_bytes_sum"] <= 0 {
		t.Errorf("snapshot frozen time and size not observed once per snapshot:\n%s", ftkitSamples(m1))
	}
	if m1["ftkit_snapshot_ship_bytes_total"] <= 0 || m1["ftkit_snapshot_ship_throughput_bytes_per_second"] <= 0 {
		t.Errorf("shipping not observed:\n%s", ftkitSamples(m1))
	}

	// A manual checkpoint: one more snapshot, counted by the time the call returns.
	reply, err := c.Client("node1").Checkpoint(ctx, job)
	if err != nil || len(reply.Results) != 1 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint: %+v, %v", reply, err)
	}
	m2 := scrape(t, c, "node1")
	if m2["ftkit_snapshots_total"] < m1["ftkit_snapshots_total"]+1 || m2["ftkit_snapshot_ships_total"] < m1["ftkit_snapshot_ships_total"]+1 {
		t.Errorf("after a checkpoint: snapshots %v -> %v, ships %v -> %v; want each up by at least 1",
			m1["ftkit_snapshots_total"], m2["ftkit_snapshots_total"], m1["ftkit_snapshot_ships_total"], m2["ftkit_snapshot_ships_total"])
	}

	// The log grows with the rank's traffic to node2: copied as it leaves, or parked (segments of 4 KiB or
	// more, log.park). The copied bytes alone may not grow for a while: in ci321 the rank's segments were
	// all parked for a minute (5 copied, 5176 bytes, against 317 MB parked).
	logged := func(m map[string]float64) float64 {
		return m["ftkit_log_logged_bytes_total"] + m["ftkit_log_parked_bytes_total"]
	}
	pollMetrics(t, c, "node1", "log bytes grow", time.Minute, func(m map[string]float64) bool {
		return logged(m) > logged(m2) && m["ftkit_log_connections"] >= 1
	})
	// Heartbeats: node1 sends them to node2, which watches node1 as its predecessor.
	if m2[`ftkit_heartbeats_sent_total{result="sent"}`] <= 0 {
		t.Errorf("node1 sent no heartbeat:\n%s", ftkitSamples(m2))
	}
	pollMetrics(t, c, "node2", "node2 sees node1's heartbeats", 30*time.Second, func(m map[string]float64) bool {
		age, ok := m[`ftkit_predecessor_heartbeat_age_seconds{node="node1"}`]
		return ok && age >= 0 && m[`ftkit_jobs{state="running"}`] == 1
	})
}

// TestMetricsRecovery: after a node crash, the protector counts a confirmed suspicion, every surviving
// agent reports the finished recovery with its stage durations (the failure log travels with the view),
// and the restored rank counts as a running job on the spare.
func TestMetricsRecovery(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", MetricsListen: metricsAddr})
	// Long enough to be running still when the crash comes; the test stops it with the lab.
	rg := startRing(t, c, 3, 7390, ringArgs(1_000_000, 64<<10, 10*time.Millisecond))
	rg.waitProtected(t, 2*time.Minute)
	rg.waitProgress(t, progressEvery, 2*time.Minute) // the ranks exchange: their connections exist
	// The start snapshot may predate them (a rank's agent dumps it as it starts); the agent snapshots it
	// again once it finds connections the replica lacks. A crash before that would not be recoverable
	// (TestConnectionAfterSnapshot).
	rg.waitCovered(t, 2*time.Minute)
	if m := scrape(t, c, "spare1"); m[`ftkit_jobs{state="running"}`] != 0 || m[`ftkit_recoveries{state="done"}`] != 0 {
		t.Fatalf("before the crash, spare1 reports:\n%s", ftkitSamples(m))
	}
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node2", 5*time.Minute)
	logTimeline(t, f)
	if f.Error != "" {
		t.Fatalf("recovery of node2 failed: %s", f.Error)
	}
	// node3 is node2's protector: it suspected node2 and confirmed the failure.
	m := pollMetrics(t, c, "node3", "the protector reports the recovery", 30*time.Second, func(m map[string]float64) bool {
		return m[`ftkit_recoveries{state="done"}`] == 1 && m[`ftkit_suspicions_total{outcome="confirmed"}`] >= 1
	})
	if m["ftkit_recovery_seconds_count"] != 1 || m["ftkit_recovery_seconds_sum"] <= 0 {
		t.Errorf("node3: recovery duration not reported:\n%s", ftkitSamples(m))
	}
	for _, stage := range []string{"detected", "spare claimed", "snapshot fetched", "restored", "replay done", "re-protected"} {
		if m[fmt.Sprintf(`ftkit_recovery_stage_seconds_count{stage=%q}`, stage)] < 1 {
			t.Errorf("node3: stage %q not reported:\n%s", stage, ftkitSamples(m))
		}
	}
	// The failure log reaches the other members with the view; the restored rank runs on spare1.
	pollMetrics(t, c, "node1", "node1 learns of the recovery", 30*time.Second, func(m map[string]float64) bool {
		return m[`ftkit_recoveries{state="done"}`] == 1 && m[`ftkit_recovery_stage_seconds_count{stage="restored"}`] >= 1
	})
	pollMetrics(t, c, "spare1", "the restored rank runs on spare1", 30*time.Second, func(m map[string]float64) bool {
		return m[`ftkit_jobs{state="running"}`] == 1
	})
}
