package agent

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// A member names each connection of its unprotected processes once a day, however often the jobs' agents
// ask (once per replica), and remembers a bounded number of them.
func TestUnloggedReports(t *testing.T) {
	flow := func(port uint16) tcpflow.Tuple {
		return tcpflow.Tuple{Local: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.2"), port), Remote: netip.MustParseAddrPort("10.0.0.1:7480")}
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
		{time.Minute, []tcpflow.Tuple{a, b}, nil},                        // the next replica: said already
		{time.Hour, []tcpflow.Tuple{b, c}, []tcpflow.Tuple{c}},           // a new connection alone
		{unloggedReportEvery, []tcpflow.Tuple{a, c}, []tcpflow.Tuple{a}}, // a again after a day; c named an hour later
		{unloggedReportEvery + time.Hour, []tcpflow.Tuple{a, b, c}, []tcpflow.Tuple{b, c}},
	} {
		if got := u.fresh(step.flows, t0.Add(step.at)); !slices.Equal(got, step.want) {
			t.Fatalf("at +%v, asked about %v: named %v, want %v", step.at, step.flows, got, step.want)
		}
	}

	// Bounded: beyond maxUnloggedReports the one named longest ago is forgotten, and named again when asked.
	var v unloggedReports
	for i := range maxUnloggedReports {
		v.fresh([]tcpflow.Tuple{flow(uint16(1000 + i))}, t0.Add(time.Duration(i)*time.Second))
	}
	late := t0.Add(maxUnloggedReports * time.Second)
	if got := v.fresh([]tcpflow.Tuple{flow(999)}, late); len(got) != 1 || len(v.seen) != maxUnloggedReports {
		t.Fatalf("one more connection at the bound: named %v, %d remembered; want it named, %d remembered", got, len(v.seen), maxUnloggedReports)
	}
	if got := v.fresh([]tcpflow.Tuple{flow(1000)}, late); len(got) != 1 {
		t.Errorf("the connection named first, forgotten at the bound: named %v, want it named again", got)
	}
	if got := v.fresh([]tcpflow.Tuple{flow(1001 + 100)}, late); len(got) != 0 {
		t.Errorf("a connection named recently and not forgotten: named %v again", got)
	}
}
