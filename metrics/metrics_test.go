package metrics

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

type fakeSource struct{ st State }

func (f *fakeSource) MetricsState() State { return f.st }

func TestCollector(t *testing.T) {
	tests := []struct {
		name  string
		state State
		names []string // the metrics compared
		want  string
	}{
		{
			name: "no jobs, no log, no failures: the zeros are there",
			names: []string{"ftkit_jobs", "ftkit_jobs_unreplicated", "ftkit_recoveries", "ftkit_log_memory_bytes",
				"ftkit_predecessor_heartbeat_age_seconds"},
			want: `
# HELP ftkit_jobs Job records of this host, by state.
# TYPE ftkit_jobs gauge
ftkit_jobs{state="exited"} 0
ftkit_jobs{state="lost"} 0
ftkit_jobs{state="running"} 0
# HELP ftkit_jobs_unreplicated Running jobs with no replica on a protector yet: a failure of this host loses them.
# TYPE ftkit_jobs_unreplicated gauge
ftkit_jobs_unreplicated 0
# HELP ftkit_recoveries Recoveries in the failure log, by state: running, done, failed. The log holds the newest failures and every member holds the same one: aggregate across agents with max, not sum.
# TYPE ftkit_recoveries gauge
ftkit_recoveries{state="done"} 0
ftkit_recoveries{state="failed"} 0
ftkit_recoveries{state="running"} 0
`,
		},
		{
			name: "jobs by state; replica age of running jobs only",
			state: State{Jobs: []Job{
				{ID: "a-1", State: "running", Replicated: true, ReplicaAge: 1500 * time.Millisecond},
				{ID: "b-2", State: "running"},
				{ID: "e-5", State: "running", Replicated: true, ReplicaAge: time.Second, Uncovered: true},
				{ID: "f-6", State: "running", Replicated: true, ReplicaAge: 2 * time.Second, Unrecoverable: true},
				{ID: "c-3", State: "exited", Replicated: true, ReplicaAge: time.Hour, Unrecoverable: true},
				{ID: "d-4", State: "lost"},
			}},
			names: []string{"ftkit_jobs", "ftkit_jobs_unreplicated", "ftkit_jobs_uncovered", "ftkit_jobs_unrecoverable", "ftkit_job_replica_age_seconds"},
			want: `
# HELP ftkit_job_replica_age_seconds Age of a running job's newest replica (since its protector had it): the work a failure of this host would lose is at most this old.
# TYPE ftkit_job_replica_age_seconds gauge
ftkit_job_replica_age_seconds{job="a-1"} 1.5
ftkit_job_replica_age_seconds{job="e-5"} 1
ftkit_job_replica_age_seconds{job="f-6"} 2
# HELP ftkit_jobs Job records of this host, by state.
# TYPE ftkit_jobs gauge
ftkit_jobs{state="exited"} 1
ftkit_jobs{state="lost"} 1
ftkit_jobs{state="running"} 4
# HELP ftkit_jobs_uncovered Running jobs whose replica lacks connections they opened since (the agent snapshots them again soon): a failure of this host now is refused for them.
# TYPE ftkit_jobs_uncovered gauge
ftkit_jobs_uncovered 1
# HELP ftkit_jobs_unrecoverable Running jobs whose replica holds connections no restore could rebuild (a peer whose sends nobody logs, or one on this host dumped apart from the job; ftctl status: UNRECOVERABLE): a failure of this host now is refused for them, and a new snapshot does not change that.
# TYPE ftkit_jobs_unrecoverable gauge
ftkit_jobs_unrecoverable 1
# HELP ftkit_jobs_unreplicated Running jobs with no replica on a protector yet: a failure of this host loses them.
# TYPE ftkit_jobs_unreplicated gauge
ftkit_jobs_unreplicated 1
`,
		},
		{
			name: "log against its cap, bytes logged, drops by reason",
			state: State{Log: &Log{MemoryBytes: 3 << 20, CapBytes: 64 << 20, PooledBytes: 1 << 20, Conns: 2, BytesLogged: 12345, ConsumerPaused: true, ConsumerCPU: 1500 * time.Millisecond,
				DropsBackpressure: 7, FragmentsPassed: 1, ReleasedBytes: 99, ReceiveDropsError: 2, ReceiveUnrecordedPassed: 3, Kicks: 3, LoggedPassed: 4, ReserveLogged: 5,
				ParkCapBytes: 8 << 20, ParkWaitingBytes: 1 << 20, BytesParked: 100, ParkFreed: 60, ParkTaken: 30, ParkLost: 1}},
			names: []string{"ftkit_log_memory_bytes", "ftkit_log_memory_cap_bytes", "ftkit_log_pooled_bytes", "ftkit_log_connections", "ftkit_log_consumer_paused", "ftkit_log_consumer_cpu_seconds_total",
				"ftkit_log_logged_bytes_total", "ftkit_log_drops_total", "ftkit_log_kicks_total", "ftkit_log_logged_passed_total", "ftkit_log_reserve_logged_total", "ftkit_log_released_bytes_total", "ftkit_receive_drops_total",
				"ftkit_log_park_bytes", "ftkit_log_park_cap_bytes", "ftkit_log_parked_bytes_total", "ftkit_log_park_left_bytes_total"},
			want: `
# HELP ftkit_log_connections Connections in the sender-side log.
# TYPE ftkit_log_connections gauge
ftkit_log_connections 2
# HELP ftkit_log_consumer_cpu_seconds_total CPU time of the log consumer's thread: what logging costs in user space (the probe's copy into the ring runs in the senders' context).
# TYPE ftkit_log_consumer_cpu_seconds_total counter
ftkit_log_consumer_cpu_seconds_total 1.5
# HELP ftkit_log_consumer_paused 1 while the log is at its cap and stops draining the ring buffer (TCP backpressure on the jobs).
# TYPE ftkit_log_consumer_paused gauge
ftkit_log_consumer_paused 1
# HELP ftkit_log_drops_total Segments the log did not take, by reason: backpressure, oversize, error (dropped; TCP retransmits them), fragment (passed unlogged: must stay 0), consumer_gone (passed unlogged: the agent took nothing from the full ring for 4 s; the receivers are not recoverable until their next snapshot), append_error (a record the consumer could not append), park_lost (a parked clone missing or not the one expected: must stay 0).
# TYPE ftkit_log_drops_total counter
ftkit_log_drops_total{reason="append_error"} 0
ftkit_log_drops_total{reason="backpressure"} 7
ftkit_log_drops_total{reason="consumer_gone"} 0
ftkit_log_drops_total{reason="error"} 0
ftkit_log_drops_total{reason="fragment"} 1
ftkit_log_drops_total{reason="oversize"} 0
ftkit_log_drops_total{reason="park_lost"} 1
# HELP ftkit_log_kicks_total Sockets the log pushed once its ring had room again after dropping their segments for backpressure, instead of leaving them to TCP's window probe timer (200 ms or more).
# TYPE ftkit_log_kicks_total counter
ftkit_log_kicks_total 3
# HELP ftkit_log_logged_bytes_total Payload bytes the egress probe wrote to the log, retransmissions included.
# TYPE ftkit_log_logged_bytes_total counter
ftkit_log_logged_bytes_total 12345
# HELP ftkit_log_logged_passed_total Segments passed unlogged while the log's ring was full because every byte of them had a record already (retransmissions).
# TYPE ftkit_log_logged_passed_total counter
ftkit_log_logged_passed_total 4
# HELP ftkit_log_memory_bytes Memory of the sender-side log (RAM, pooled and compressed); less ftkit_log_pooled_bytes, compare with ftkit_log_memory_cap_bytes.
# TYPE ftkit_log_memory_bytes gauge
ftkit_log_memory_bytes 3.145728e+06
# HELP ftkit_log_memory_cap_bytes Cap on the sender-side log's memory (log.memory_mib).
# TYPE ftkit_log_memory_cap_bytes gauge
ftkit_log_memory_cap_bytes 6.7108864e+07
# HELP ftkit_log_park_bytes Payload bytes waiting in parked clones of sent segments (log.park): kernel memory, outside ftkit_log_memory_bytes.
# TYPE ftkit_log_park_bytes gauge
ftkit_log_park_bytes 1.048576e+06
# HELP ftkit_log_park_cap_bytes Cap on ftkit_log_park_bytes (log.park_mib); past three quarters of it the oldest clones are taken into the log.
# TYPE ftkit_log_park_cap_bytes gauge
ftkit_log_park_cap_bytes 8.388608e+06
# HELP ftkit_log_park_left_bytes_total Parked payload bytes that left the park, by fate: freed (unread: a receiver's snapshot covered them, nothing was copied) or taken (copied into the log: a recovery needed them, or the park was three quarters full).
# TYPE ftkit_log_park_left_bytes_total counter
ftkit_log_park_left_bytes_total{fate="freed"} 60
ftkit_log_park_left_bytes_total{fate="taken"} 30
# HELP ftkit_log_parked_bytes_total Payload bytes the egress probe parked as clones instead of copying them into the log.
# TYPE ftkit_log_parked_bytes_total counter
ftkit_log_parked_bytes_total 100
# HELP ftkit_log_pooled_bytes Part of ftkit_log_memory_bytes holding no logged bytes: buffers freed by trims, kept for reuse up to 10 minutes; not counted against the cap.
# TYPE ftkit_log_pooled_bytes gauge
ftkit_log_pooled_bytes 1.048576e+06
# HELP ftkit_log_reserve_logged_total Segments of connections held back 2 s or more while the log was paused at its cap, let through its ring's reserve so that TCP does not give up on them.
# TYPE ftkit_log_reserve_logged_total counter
ftkit_log_reserve_logged_total 5
# HELP ftkit_log_released_bytes_total Logged bytes the freed logs of finished connections still retained.
# TYPE ftkit_log_released_bytes_total counter
ftkit_log_released_bytes_total 99
# HELP ftkit_receive_drops_total Segments the receive tap did not record, by reason: backpressure, oversize, error (dropped; the sender retransmits them), consumer_gone (passed unrecorded: the agent took nothing from the full ring for 4 s; the senders' recoveries are refused until their next snapshots).
# TYPE ftkit_receive_drops_total counter
ftkit_receive_drops_total{reason="backpressure"} 0
ftkit_receive_drops_total{reason="consumer_gone"} 3
ftkit_receive_drops_total{reason="error"} 2
ftkit_receive_drops_total{reason="oversize"} 0
`,
		},
		{
			name:  "predecessor's heartbeat age and busy, absent before its first beat",
			state: State{Predecessor: &Predecessor{Node: "node1", Beaten: true, BeatAge: 250 * time.Millisecond, Busy: true}},
			names: []string{"ftkit_predecessor_heartbeat_age_seconds", "ftkit_predecessor_busy"},
			want: `
# HELP ftkit_predecessor_busy 1 if the last heartbeat of the ring predecessor this agent watches said it was checkpointing or restoring (absent before the first).
# TYPE ftkit_predecessor_busy gauge
ftkit_predecessor_busy{node="node1"} 1
# HELP ftkit_predecessor_heartbeat_age_seconds Time since the last heartbeat of the ring predecessor this agent watches (absent before the first).
# TYPE ftkit_predecessor_heartbeat_age_seconds gauge
ftkit_predecessor_heartbeat_age_seconds{node="node1"} 0.25
`,
		},
		{
			name: "recoveries by state, stage durations, whole recoveries",
			state: State{Failures: []Failure{
				{ID: "a", Done: true, Duration: 4 * time.Second, Stages: []Stage{{Name: "detected"}, {Name: "restored", Duration: 2 * time.Second, Seq: 1}}},
				{ID: "b", Done: true, Failed: true, Stages: []Stage{{Name: "restored", Duration: 200 * time.Second}}},
				{ID: "c", Stages: []Stage{{Name: "detected"}}},
			}},
			names: []string{"ftkit_recoveries", "ftkit_recovery_stage_seconds", "ftkit_recovery_seconds"},
			want: `
# HELP ftkit_recoveries Recoveries in the failure log, by state: running, done, failed. The log holds the newest failures and every member holds the same one: aggregate across agents with max, not sum.
# TYPE ftkit_recoveries gauge
ftkit_recoveries{state="done"} 1
ftkit_recoveries{state="failed"} 1
ftkit_recoveries{state="running"} 1
# HELP ftkit_recovery_seconds Durations of the finished recoveries in the failure log, from detection to the end of the last stage; each counted once, kept when the bounded log drops it.
# TYPE ftkit_recovery_seconds histogram
ftkit_recovery_seconds_bucket{le="0.01"} 0
ftkit_recovery_seconds_bucket{le="0.05"} 0
ftkit_recovery_seconds_bucket{le="0.1"} 0
ftkit_recovery_seconds_bucket{le="0.25"} 0
ftkit_recovery_seconds_bucket{le="0.5"} 0
ftkit_recovery_seconds_bucket{le="1"} 0
ftkit_recovery_seconds_bucket{le="2.5"} 0
ftkit_recovery_seconds_bucket{le="5"} 1
ftkit_recovery_seconds_bucket{le="10"} 1
ftkit_recovery_seconds_bucket{le="30"} 1
ftkit_recovery_seconds_bucket{le="60"} 1
ftkit_recovery_seconds_bucket{le="120"} 1
ftkit_recovery_seconds_bucket{le="300"} 1
ftkit_recovery_seconds_bucket{le="600"} 1
ftkit_recovery_seconds_bucket{le="+Inf"} 1
ftkit_recovery_seconds_sum 4
ftkit_recovery_seconds_count 1
# HELP ftkit_recovery_stage_seconds Durations of the finished stages of the recoveries in the failure log (the same on every member), by stage; each counted once, kept when the bounded log drops it.
# TYPE ftkit_recovery_stage_seconds histogram
ftkit_recovery_stage_seconds_bucket{stage="detected",le="0.01"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="0.05"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="0.1"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="0.25"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="0.5"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="1"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="2.5"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="5"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="10"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="30"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="60"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="120"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="300"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="600"} 2
ftkit_recovery_stage_seconds_bucket{stage="detected",le="+Inf"} 2
ftkit_recovery_stage_seconds_sum{stage="detected"} 0
ftkit_recovery_stage_seconds_count{stage="detected"} 2
ftkit_recovery_stage_seconds_bucket{stage="restored",le="0.01"} 0
ftkit_recovery_stage_seconds_bucket{stage="restored",le="0.05"} 0
ftkit_recovery_stage_seconds_bucket{stage="restored",le="0.1"} 0
ftkit_recovery_stage_seconds_bucket{stage="restored",le="0.25"} 0
ftkit_recovery_stage_seconds_bucket{stage="restored",le="0.5"} 0
ftkit_recovery_stage_seconds_bucket{stage="restored",le="1"} 0
ftkit_recovery_stage_seconds_bucket{stage="restored",le="2.5"} 1
ftkit_recovery_stage_seconds_bucket{stage="restored",le="5"} 1
ftkit_recovery_stage_seconds_bucket{stage="restored",le="10"} 1
ftkit_recovery_stage_seconds_bucket{stage="restored",le="30"} 1
ftkit_recovery_stage_seconds_bucket{stage="restored",le="60"} 1
ftkit_recovery_stage_seconds_bucket{stage="restored",le="120"} 1
ftkit_recovery_stage_seconds_bucket{stage="restored",le="300"} 2
ftkit_recovery_stage_seconds_bucket{stage="restored",le="600"} 2
ftkit_recovery_stage_seconds_bucket{stage="restored",le="+Inf"} 2
ftkit_recovery_stage_seconds_sum{stage="restored"} 202
ftkit_recovery_stage_seconds_count{stage="restored"} 2
`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := New(&fakeSource{tt.state})
			if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(tt.want), tt.names...); err != nil {
				t.Error(err)
			}
		})
	}
}

// The collector reads the state at every scrape: a value that changes between two scrapes moves.
func TestCollectorReadsAtScrape(t *testing.T) {
	src := &fakeSource{State{Log: &Log{BytesLogged: 10}}}
	m := New(src)
	if got := gathered(t, m, "ftkit_log_logged_bytes_total"); got != 10 {
		t.Fatalf("logged bytes %v, want 10", got)
	}
	src.st.Log.BytesLogged = 4096
	if got := gathered(t, m, "ftkit_log_logged_bytes_total"); got != 4096 {
		t.Fatalf("logged bytes %v after the log grew, want 4096", got)
	}
}

// gathered is the value of the unlabelled counter or gauge name in m's registry.
func gathered(t *testing.T, m *Metrics, name string) float64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.GetMetric()) != 1 {
			continue
		}
		if c := mf.GetMetric()[0].GetCounter(); c != nil {
			return c.GetValue()
		}
		return mf.GetMetric()[0].GetGauge().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func TestEvents(t *testing.T) {
	m := New(&fakeSource{})
	m.SnapshotTaken(2*time.Second, 30*time.Millisecond, 1<<20)
	m.SnapshotTaken(time.Second, 20*time.Millisecond, 1<<20)
	m.SnapshotShipped(8<<20, 2<<20, 2*time.Second)
	m.ShipFailed()
	m.Heartbeat(true)
	m.Heartbeat(true)
	m.Heartbeat(false)
	m.Suspicion(true)
	m.UnresponsiveAgent()
	m.UnresponsiveAgent()
	m.BusySilence()
	m.HeartbeatGap(75*time.Millisecond, true)
	m.HeartbeatGap(180*time.Millisecond, false)
	m.ControllerEvent("snapshot-requested")
	m.ControllerEvent("snapshot-requested")
	want := `
# HELP ftkit_busy_silences_total Times the ring predecessor was silent for heartbeat.timeout while its last beat said it was checkpointing or restoring, and its host still answered a TCP handshake: left alone, up to heartbeat.busy_grace (not a suspicion).
# TYPE ftkit_busy_silences_total counter
ftkit_busy_silences_total 1
# HELP ftkit_heartbeats_sent_total Heartbeats to this node's protector, by result: sent, or failed (protector unreachable or the write failed).
# TYPE ftkit_heartbeats_sent_total counter
ftkit_heartbeats_sent_total{result="failed"} 1
ftkit_heartbeats_sent_total{result="sent"} 2
# HELP ftkit_log_controller_events_total Decisions of the sender-side log's resource controller, by kind (snapshot-requested, spill, pause-consumer, ...).
# TYPE ftkit_log_controller_events_total counter
ftkit_log_controller_events_total{kind="snapshot-requested"} 2
# HELP ftkit_snapshot_ship_bytes_total Snapshot bytes shipped to protectors.
# TYPE ftkit_snapshot_ship_bytes_total counter
ftkit_snapshot_ship_bytes_total 8.388608e+06
# HELP ftkit_snapshot_ship_failures_total Snapshots that reached no protector (the job stays protected by its previous replica, if any).
# TYPE ftkit_snapshot_ship_failures_total counter
ftkit_snapshot_ship_failures_total 1
# HELP ftkit_snapshot_ship_throughput_bytes_per_second Snapshot bytes per second of the last shipment (rate(ftkit_snapshot_ship_bytes_total) / rate(ftkit_snapshot_ship_seconds_sum) over a window).
# TYPE ftkit_snapshot_ship_throughput_bytes_per_second gauge
ftkit_snapshot_ship_throughput_bytes_per_second 4.194304e+06
# HELP ftkit_snapshots_total Snapshots of this host's jobs taken (committed to the local store).
# TYPE ftkit_snapshots_total counter
ftkit_snapshots_total 2
# HELP ftkit_suspicions_total Suspicions of the ring predecessor after heartbeat silence, by outcome: cleared (it was reachable), agent_unresponsive (its agent did not answer but its host did, and no fence command is configured: not failed over, since its jobs may still run there) or confirmed (declared failed).
# TYPE ftkit_suspicions_total counter
ftkit_suspicions_total{outcome="agent_unresponsive"} 2
ftkit_suspicions_total{outcome="cleared"} 1
ftkit_suspicions_total{outcome="confirmed"} 0
`
	if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(want), "ftkit_busy_silences_total", "ftkit_heartbeats_sent_total",
		"ftkit_log_controller_events_total", "ftkit_snapshot_ship_bytes_total", "ftkit_snapshot_ship_failures_total",
		"ftkit_snapshot_ship_throughput_bytes_per_second", "ftkit_snapshots_total", "ftkit_suspicions_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(m.beatGaps, "ftkit_predecessor_heartbeat_gap_seconds"); n != 2 {
		t.Errorf("heartbeat gap histogram: %d series, want one per side", n)
	}
	if n := testutil.CollectAndCount(m.frozenSeconds); n != 1 {
		t.Errorf("frozen time histogram: %d series", n)
	}
	if got := testutil.ToFloat64(m.snapshots); got != 2 {
		t.Errorf("snapshots %v", got)
	}
	// The whole registry passes the linter (names, units, help).
	problems, err := testutil.GatherAndLint(m.Registry())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "ftkit_") {
			t.Errorf("lint: %s: %s", p.Metric, p.Text)
		}
	}
}

// An agent built without metrics (a nil *Metrics) records nothing and does not crash.
func TestNilMetrics(t *testing.T) {
	var m *Metrics
	calls := map[string]func(){
		"SnapshotTaken":     func() { m.SnapshotTaken(time.Second, time.Millisecond, 1) },
		"SnapshotShipped":   func() { m.SnapshotShipped(1, 1, time.Second) },
		"ShipFailed":        m.ShipFailed,
		"Heartbeat":         func() { m.Heartbeat(true) },
		"Suspicion":         func() { m.Suspicion(false) },
		"UnresponsiveAgent": m.UnresponsiveAgent,
		"ControllerEvent":   func() { m.ControllerEvent("spill") },
	}
	for name, call := range calls {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("%s on a nil *Metrics panicked: %v", name, r)
				}
			}()
			call()
		}()
	}
}

func TestCheckListen(t *testing.T) {
	tests := []struct {
		addr string
		ok   bool
	}{
		{"", true},
		{"127.0.0.1:9464", true},
		{"[::1]:9464", true},
		{"0.0.0.0:9464", true},
		{"localhost:9464", false}, // a name would be resolved at every start: an ip is what the agent binds
		{"127.0.0.1", false},
		{"127.0.0.1:0", false},
		{":9464", false},
		{"127.0.0.1:99999", false},
	}
	for _, tt := range tests {
		if err := CheckListen(tt.addr); (err == nil) != tt.ok {
			t.Errorf("CheckListen(%q) = %v, want ok=%v", tt.addr, err, tt.ok)
		}
	}
}

// Serve answers /metrics over HTTP, refuses a taken port, and stops when its context ends.
func TestServe(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	m := New(&fakeSource{State{Jobs: []Job{{ID: "j-1", State: "running"}}}})
	m.SnapshotTaken(time.Second, time.Millisecond, 4096)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv, err := m.Serve(ctx, "127.0.0.1:0", log)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	resp, err := http.Get("http://" + srv.Addr + Path)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`ftkit_jobs{state="running"} 1`, "ftkit_snapshots_total 1", "go_goroutines", "process_open_fds"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("scrape lacks %q:\n%s", want, body)
		}
	}
	if resp, err := http.Get("http://" + srv.Addr + "/other"); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /other: %v, %v; want 404", resp, err)
	} else {
		resp.Body.Close()
	}

	if _, err := m.Serve(ctx, srv.Addr, log); err == nil {
		t.Error("a second endpoint on a taken port was started")
	}
	cancel()
	// Shutdown closes the listener: poll until connections are refused (a generous bound, never a guess).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", srv.Addr, time.Second)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("the endpoint still accepts connections after its context ended")
		}
	}
}

// The recovery histograms are built from the failure log, which is bounded: a failure that leaves it, or a
// long recovery's middle stages that leave its timeline, must not take their counts along (a histogram
// that goes down is a reset to Prometheus), and one seen again at the next scrape is not counted twice.
func TestRecoveryHistogramsNeverDecrease(t *testing.T) {
	src := &fakeSource{State{Failures: []Failure{
		{ID: "n1-a", Done: true, Duration: 3 * time.Second, Stages: []Stage{{Name: "detected", Duration: time.Second}, {Name: "restored", Duration: 2 * time.Second, Seq: 1}}},
		{ID: "n2-b", Stages: []Stage{{Name: "detected", Duration: time.Second}}},
	}}}
	m := New(src)
	check := func(when string, recoveries, detected, restored uint64) {
		t.Helper()
		got := histogramCounts(t, m)
		want := map[string]uint64{"recovery": recoveries, "detected": detected, "restored": restored}
		for k, w := range want {
			if got[k] != w {
				t.Errorf("%s: %s count %d, want %d (all: %v)", when, k, got[k], w, got)
			}
		}
	}
	check("first scrape", 1, 2, 1)
	check("same log again", 1, 2, 1)

	// n1-a left the bounded log; n2-b went on, its middle stages dropped (the log keeps the first and the
	// newest), and finished.
	src.st.Failures = []Failure{
		{ID: "n2-b", Done: true, Duration: 9 * time.Second, Stages: []Stage{{Name: "detected", Duration: time.Second},
			{Name: "restored", Duration: time.Second, Seq: 5}}},
	}
	check("after the log dropped a failure", 2, 2, 2)
	check("same log again", 2, 2, 2)
}

// histogramCounts reads the sample counts of ftkit_recovery_seconds ("recovery") and of
// ftkit_recovery_stage_seconds by stage.
func histogramCounts(t *testing.T, m *Metrics) map[string]uint64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			switch mf.GetName() {
			case "ftkit_recovery_seconds":
				out["recovery"] = mt.GetHistogram().GetSampleCount()
			case "ftkit_recovery_stage_seconds":
				for _, l := range mt.GetLabel() {
					if l.GetName() == "stage" {
						out[l.GetValue()] = mt.GetHistogram().GetSampleCount()
					}
				}
			}
		}
	}
	return out
}

// A failure the bounded log dropped may come back into it (a newer copy from its protector, ordered by its
// update when it has no detection time): what was counted of it is not counted again, only what is new.
func TestRecoveryHistogramsFailureReenters(t *testing.T) {
	done := Failure{ID: "n1-a", Done: true, Duration: 3 * time.Second, Stages: []Stage{{Name: "detected", Duration: time.Second}, {Name: "restored", Duration: 2 * time.Second, Seq: 1}}}
	running := Failure{ID: "n1-a", Stages: []Stage{{Name: "detected", Duration: time.Second}}}
	other := Failure{ID: "n2-b", Stages: []Stage{{Name: "detected", Duration: time.Second}}}
	for _, tc := range []struct {
		name                           string
		first, again                   Failure
		recoveries, detected, restored uint64
	}{
		{"done, back the same", done, done, 1, 2, 1},
		{"running, back done", running, done, 1, 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := &fakeSource{State{Failures: []Failure{tc.first}}}
			m := New(src)
			histogramCounts(t, m)
			src.st.Failures = []Failure{other} // tc.first left the bounded log
			histogramCounts(t, m)
			src.st.Failures = []Failure{tc.again, other} // and came back
			got := histogramCounts(t, m)
			want := map[string]uint64{"recovery": tc.recoveries, "detected": tc.detected, "restored": tc.restored}
			for k, w := range want {
				if got[k] != w {
					t.Errorf("%s count %d, want %d (all: %v)", k, got[k], w, got)
				}
			}
		})
	}
}
