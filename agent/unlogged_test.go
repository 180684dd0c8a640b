package agent

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/tcpflow"
)

// A member names each connection of its unprotected processes once a day, however often the jobs' agents
// ask (once per replica), at most unloggedReportsPerHour an hour, and remembers a bounded number of them.
func TestUnloggedReports(t *testing.T) {
	flow := func(port int) tcpflow.Tuple {
		return tcpflow.Tuple{Local: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.2"), uint16(port)), Remote: netip.MustParseAddrPort("10.0.0.1:7480")}
	}
	a, b, c := flow(1), flow(2), flow(3)
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	var u unloggedReports
	for _, step := range []struct {
		at    time.Duration
		flows []tcpflow.Tuple
		want  []tcpflow.Tuple
	}{
		{0, nil, nil},
		{0, []tcpflow.Tuple{a, b}, []tcpflow.Tuple{a, b}},
		{time.Minute, []tcpflow.Tuple{a, b}, nil},                        // the next replica: named already
		{time.Hour, []tcpflow.Tuple{b, c}, []tcpflow.Tuple{c}},           // a new connection alone
		{unloggedReportEvery, []tcpflow.Tuple{a, c}, []tcpflow.Tuple{a}}, // a again after a day; c was named an hour later
		{unloggedReportEvery + time.Hour, []tcpflow.Tuple{a, b, c}, []tcpflow.Tuple{b, c}},
	} {
		if got, unnamed := u.fresh(step.flows, t0.Add(step.at)); !slices.Equal(got, step.want) || unnamed != 0 {
			t.Fatalf("at +%v, asked about %v: named %v (%d kept back), want %v", step.at, step.flows, got, unnamed, step.want)
		}
	}

	t.Run("an hour's budget", func(t *testing.T) {
		var v unloggedReports
		var many []tcpflow.Tuple
		for i := range unloggedReportsPerHour + 44 {
			many = append(many, flow(1000+i))
		}
		if got, unnamed := v.fresh(many, t0); len(got) != unloggedReportsPerHour || unnamed != 44 {
			t.Fatalf("%d connections at once: named %d, %d kept back; want %d and 44", len(many), len(got), unnamed, unloggedReportsPerHour)
		}
		if got, unnamed := v.fresh(many, t0.Add(59*time.Minute)); len(got) != 0 || unnamed != 0 {
			t.Fatalf("asked again within the hour: named %d, %d kept back said again; want 0 and the count said once an hour", len(got), unnamed)
		}
		if got, unnamed := v.fresh(many, t0.Add(time.Hour)); !slices.Equal(got, many[unloggedReportsPerHour:]) || unnamed != 0 {
			t.Fatalf("asked again the next hour: named %v, %d kept back; want the 44 kept back", got, unnamed)
		}
	})

	t.Run("bounded memory", func(t *testing.T) {
		// Beyond maxUnloggedReports the one named longest ago is forgotten, and named again when asked.
		var v unloggedReports
		for i := range maxUnloggedReports {
			v.fresh([]tcpflow.Tuple{flow(1000 + i)}, t0.Add(time.Duration(i)*time.Hour))
		}
		late := t0.Add(maxUnloggedReports * time.Hour)
		if got, _ := v.fresh([]tcpflow.Tuple{flow(999)}, late); len(got) != 1 || len(v.seen) != maxUnloggedReports {
			t.Fatalf("one more connection at the bound: named %v, %d remembered; want it named, %d remembered", got, len(v.seen), maxUnloggedReports)
		}
		if _, ok := v.seen[flow(1000)]; ok {
			t.Errorf("the connection named first is still remembered at the bound")
		}
		if got, _ := v.fresh([]tcpflow.Tuple{flow(1000 + maxUnloggedReports - 1)}, late); len(got) != 0 {
			t.Errorf("a connection named an hour ago: named %v again", got)
		}
	})
}

// The job's host says why each connection a member named cannot be replayed: an unprotected process, the
// member's log off, or a protected process whose live state the member's capture lost (until 2026-11-30 told
// as an unprotected process, and the member's log said so too).
func TestUnloggedReasons(t *testing.T) {
	a := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5000"), Remote: netip.MustParseAddrPort("10.0.0.1:7480")}
	b := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:7481")}
	for _, tc := range []struct {
		name string
		rep  clusterapi.LoggedReply
		want []string // a substring of each reason, in order
	}{
		{"all logged", clusterapi.LoggedReply{}, nil},
		{"unprotected processes", clusterapi.LoggedReply{Unlogged: []tcpflow.Tuple{a, b}},
			[]string{"10.0.0.1:7480 -> 10.0.0.2:5000: the peer is a process of node2 not started under ftkit", "10.0.0.1:7481 -> 10.0.0.2:5001: the peer is a process of node2 not started"}},
		{"the log off", clusterapi.LoggedReply{Unlogged: []tcpflow.Tuple{a}, LogOff: true}, []string{"on node2, whose sender-side log is off"}},
		{"one live state lost", clusterapi.LoggedReply{Unlogged: []tcpflow.Tuple{a, b}, StateLost: []tcpflow.Tuple{b}},
			[]string{"not started under ftkit", "10.0.0.1:7481 -> 10.0.0.2:5001: the peer is a protected process of node2, but that host's log has lost the connection's live state"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := unloggedReasons("node2", tc.rep)
			if len(got) != len(tc.want) {
				t.Fatalf("reasons %q, want %d", got, len(tc.want))
			}
			for i, w := range tc.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("reason %d: %q, want it to say %q", i, got[i], w)
				}
			}
		})
	}
}

// A member looks a socket of a job address up in that job's network: only a running job of this host holds it.
func TestJobNetHolding(t *testing.T) {
	ip := netip.MustParseAddr("10.0.0.50")
	net := func(addr string) *JobNet {
		return &JobNet{Name: "ftj-" + addr, Addr: netip.PrefixFrom(netip.MustParseAddr(addr), 24)}
	}
	for _, tc := range []struct {
		name string
		jobs map[string]*Job
		want string // the network's name, "" for none
	}{
		{"no jobs", nil, ""},
		{"a running job of this host", map[string]*Job{"j1": {State: JobRunning, Node: "node2", Net: net("10.0.0.50")}}, "ftj-10.0.0.50"},
		{"another address", map[string]*Job{"j1": {State: JobRunning, Node: "node2", Net: net("10.0.0.51")}}, ""},
		{"a job on the host's address", map[string]*Job{"j1": {State: JobRunning, Node: "node2"}}, ""},
		{"a job that ended", map[string]*Job{"j1": {State: JobExited, Node: "node2", Net: net("10.0.0.50")}}, ""},
		{"a job of another host", map[string]*Job{"j1": {State: JobRunning, Node: "node3", Net: net("10.0.0.50")}}, ""},
	} {
		name := ""
		if n := jobNetHolding(tc.jobs, "node2", ip); n != nil {
			name = n.Name
		}
		if name != tc.want {
			t.Errorf("%s: job network %q, want %q", tc.name, name, tc.want)
		}
	}
}
