package main

import "testing"

// TestParseValidityOverflow: a number of days past what a time.Duration holds (about 292 years) is refused,
// not wrapped around into some other validity.
func TestParseValidityOverflow(t *testing.T) {
	for _, in := range []string{"300000d", "2147483647d", "106752d"} {
		if d, err := parseValidity(in); err == nil {
			t.Errorf("parseValidity(%q) = %v (%d days), nil; want an error", in, d, d/(24*3600e9))
		}
	}
}
